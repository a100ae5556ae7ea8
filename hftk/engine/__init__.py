"""Training engines: the HF Trainer path (``trainer``), the custom loop (``loop``) and the world-size guard."""
