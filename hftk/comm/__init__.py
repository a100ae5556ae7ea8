"""Gradient compression and hierarchical all-reduce for DDP, with bytes-on-wire accounting.

- :mod:`hftk.comm.hooks` / :mod:`hftk.comm.powersgd`: the hooks (fp16, bf16, top-k, PowerSGD);
- :mod:`hftk.comm.collectives` / :mod:`hftk.comm.hierarchical`: what the hooks send through
  (one flat group, or node-local + node-leader groups);
- :mod:`hftk.comm.accounting`: bytes and in-flight time per optimizer step;
- :mod:`hftk.comm.register`: validation, ``register_compression(ddp_model, cfg)``, checkpoint state;
- :mod:`hftk.comm.callback`: the Trainer callback that wires it all into a run;
- :mod:`hftk.comm.rank_failure`: regions of collectives (saves) that one rank's failure leaves without a hang.

Imports: ``core`` and ``config`` only (checkpoints and telemetry use its collectives).
"""
