"""What leaves a run for others: any checkpoint kind as a standard HF folder (``export``), Hub pushes in the
background with retries and ``hftk push`` (``hub``).

Imports: the layers below (``core`` .. ``launch``).
"""
