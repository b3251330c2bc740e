"""LoRA adapters: exllamav2's `ExLlamaV2Lora` (PEFT adapter directories), applied per row of a batch.

`ExLlamaV2Lora.from_directory(model, dir, lora_scaling=1.0)` reads an adapter; pass it to
`model.forward(..., loras=[lora])`, a generator's `set_loras(...)` / `loras=`, or a dynamic job's `loras=`.
One batched step serves rows with different adapters (and none): the adapter weights live in per-block slot
buffers (slots.py, buffers.py), each row names its slot in the step's metadata, and segmented kernels add the
adapters' outputs to the projections (block.py; exlpy/kernels/lora.py). `configure(model, max_adapters=,
max_rank=)` sizes the slots.
"""

from exlpy.lora.adapter import ExLlamaV2Lora
from exlpy.lora.slots import configure, registry_of

__all__ = ["ExLlamaV2Lora", "configure", "registry_of"]
