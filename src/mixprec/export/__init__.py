"""Train → serve: a model trained under a Linear format written in the format it
trained in, the codes and scales of its fp32 masters cast exactly as the training
forward casts them. ``save_pretrained`` writes a Hugging Face directory that
transformers and vLLM load quantized (compressed-tensors or transformers' fine-grained
fp8); ``save`` writes any module as a safetensors file and a JSON description. The
schema each format takes: ``mixprec.export.choice``; the guide: docs/guides/serve.md.
"""

from __future__ import annotations

from mixprec.export.choice import schema_for
from mixprec.export.files import save
from mixprec.export.pretrained import save_pretrained
from mixprec.export.tensors import Exported

__all__ = ["save", "save_pretrained", "schema_for", "Exported"]
