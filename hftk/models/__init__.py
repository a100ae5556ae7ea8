"""A causal LM as hftk holds it: config, tokenizer and model loading (``loading``), a family's parts on a live
model (``layout``), LoRA / QLoRA / DoRA through PEFT (``lora``), what autograd keeps, traced on the meta
device (``activations``).

Imports: the layers below (``core`` .. ``checkpoint``).
"""
