"""How a run is started: ``hftk configs`` (the accelerate YAML and DeepSpeed JSON) and the launcher's strategy
read back (``configs``), the world-size guard that stops a run meant to be distributed that is not
(``guard``).

Imports: the layers below (``core`` .. ``strategies``).
"""
