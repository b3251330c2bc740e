"""Vision-language models: image embeddings that prompts reference through token ids (exllamav2's API).

`ExLlamaV2VisionTower` (tower.py) loads a model's vision encoder and turns images into `ExLlamaV2MMEmbedding`s
(embedding.py); image decoding and limits in image.py; Qwen2-VL / Qwen2.5-VL preprocessing and tower in
qwen2.py (layers.py: shared blocks); what a forward pass needs for prompts that hold embeddings (their rows,
M-RoPE positions) in mm.py.
"""

from exlpy.compat.unsupported import ExLlamaV2MultimodalProjector
from exlpy.vision.embedding import EMBEDDING_INDEX, ExLlamaV2MMEmbedding
from exlpy.vision.tower import ExLlamaV2VisionTower

__all__ = ["ExLlamaV2MultimodalProjector", "EMBEDDING_INDEX", "ExLlamaV2MMEmbedding", "ExLlamaV2VisionTower"]
