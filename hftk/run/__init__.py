"""One run from the command line to its engine: ``prepare`` (parse, validate, read the model config and data,
then the strategy's engine), every check on user input before any process group (``validate``),
``hftk preprocess`` (``preprocess``).

Imports: every layer below; only ``bench`` and ``hftk.cli`` sit above.
"""
