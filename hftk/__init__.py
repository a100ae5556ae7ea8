"""hftk: fine-tune Hugging Face GPT-style models past one GPU.

One run flows config -> plan -> launch config -> engine -> checkpoint / export / Hub;
see docs/ARCHITECTURE.md for the map and docs/INTERNALS.md for how each part works.

bitsandbytes warns at import, on every rank, on a CPU with AVX512-BF16 when the optional ``kernels``
package is missing ("Failed to load CPU gemm_4bit_forward from kernels-community"); it is imported in every
run (transformers -> peft -> bitsandbytes), quantizing or not, before any hftk code could set the level
later, so its logger's level is set here, first. The 4-bit CPU path works without that kernel.
"""

import logging

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = "0.1.0"
