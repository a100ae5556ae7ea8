"""What a run leaves on disk and reads back: atomic checkpoints, resume lookup and RNG files (``atomic``),
the custom loop's checkpointer over stateful objects (``checkpointer``), standard HF folders (``hf_folder``),
the run record and model card (``run_record``).

Imports: the layers below (``core`` .. ``data``).
"""
