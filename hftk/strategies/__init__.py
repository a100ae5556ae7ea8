"""One module per strategy, each the single place that strategy's parallelism is applied (from outside the
model code), plus what they share: the degrees of every dimension (``parallel_dims``), the tp / cp / sp / ep
step and its checkpoints (``mesh``, ``mesh_checkpoint``), each family's TP plan (``tp_plans``).

Every strategy module answers the same questions with plain functions (no base class):

- ``validate(cfg, world_size)``: strategy-specific checks, before any process group.

A strategy driven by the HF Trainer (``engine == "trainer"``) also answers:

- ``training_arguments(cfg, model_config) -> dict``: extra ``TrainingArguments`` kwargs
  (a DeepSpeed config, DDP options, ...).
- ``prepare_model(model, cfg) -> model``: parallelism applied from outside the model code
  before the Trainer sees it (identity for DDP and DeepSpeed, which the Trainer wraps).
- ``verify(trainer)``: called at train begin; raise if the run is not really distributed
  the way its name says (the field's silent fallbacks to DDP or to one process).
- ``save_final(trainer, out_dir)``: write a complete, consolidated HF folder into the engine's final save
  (:func:`hftk.checkpoint.atomic.staged_folder`: every rank settles there, a failure on one reaches all; no
  collective after a rank-local check).
- optional ``callbacks(trainer) -> list``: Trainer callbacks the strategy needs, run after the
  world guard (DeepSpeed shares ZeRO-3's fp32 master with the parameters at train begin).
- optional ``trainer_factory(cfg) -> callable``: builds the Trainer instead of
  ``transformers.Trainer`` when the strategy owns model/optimizer I/O (FSDP2's DTensor shards).
- optional ``resume_folder(resume) -> str | None``: the folder the Trainer resumes from instead of
  ``resume`` (ZeRO-1/2 at another world size: the universal checkpoint ``training_arguments`` converted).

The custom loop's strategies (``engine == "loop"``, :mod:`hftk.engine.loop`: pipeline, tp, cp, sp, ep)
answer ``build_step(model, cfg, args)`` instead of the Trainer hooks: the step that loop drives
(the pipeline's stages; for tp / cp / sp / ep a ``layout(model, cfg, device_type) -> MeshLayout`` wrapped
by :func:`hftk.strategies.mesh.mesh_step`). Every strategy takes its degrees and meshes from :mod:`hftk.strategies.parallel_dims`.

Imports: the layers below (``core`` .. ``plan``); never the engine (the engines load strategies through
:mod:`hftk.config.strategy_table`).
"""
