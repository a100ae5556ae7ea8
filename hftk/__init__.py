"""hftk: fine-tune Hugging Face GPT-style models past one GPU.

One run flows config -> plan -> launch config -> engine -> checkpoint / export / Hub;
see docs/ARCHITECTURE.md for the map and docs/INTERNALS.md for how each part works.

On a CPU with AVX512-BF16, importing bitsandbytes tries to fetch a 4-bit kernel from the Hub through
``kernels`` and warns on every rank when it cannot ("Failed to load CPU gemm_4bit_forward from
kernels-community", and offline "Skipping publisher trust check"); it is imported in every run
(transformers -> peft -> bitsandbytes), quantizing or not, before any hftk code could set the level later,
so both loggers' levels are set here, first. The 4-bit CPU path works without that kernel.
"""

import logging

for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_name).setLevel(logging.ERROR)

__version__ = "0.1.0"
