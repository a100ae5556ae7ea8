"""Training engines: the HF Trainer path (``trainer``) and the distributed-world guard."""
