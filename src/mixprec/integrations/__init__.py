"""mixprec inside the trainers people already use. Each module imports its framework
(an optional extra: ``pip install mixprec[lightning]``); the core never imports them.

- ``mixprec.integrations.lightning``: ``MixedPrecisionPlugin``, a Lightning precision
  plugin that runs the engine underneath ``Trainer``;
- ``mixprec.integrations.fabric``: ``setup_fabric``, ``fabric.setup`` under a recipe
  (also importable from ``mixprec.integrations.lightning``);
- ``mixprec.integrations.transformers``: ``MixedPrecisionTrainer``, a Hugging Face
  ``Trainer`` whose step, backward and forward go through the engine;
- ``mixprec.integrations.accelerate``: ``prepare``, ``accelerator.prepare`` for an
  Accelerate loop whose backward and step are the engine's.
"""

__all__: list[str] = []
