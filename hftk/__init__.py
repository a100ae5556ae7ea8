"""hftk: fine-tune Hugging Face GPT-style models past one GPU.

One run flows config -> plan -> launch config -> engine -> checkpoint / export / Hub;
see docs/ARCHITECTURE.md for the map and docs/INTERNALS.md for how each part works.
"""

__version__ = "0.1.0"
