"""Training drafts on the target's own outputs (self-distillation).

  data      prompt files -> the target writes responses -> tokens, loss masks and the target's
            hidden states stored as memory-mapped .npy arrays (`write_dataset`, `Dataset`)
  trainer   AdamW training of any Flax NNX module with orbax checkpoints that resume exactly
            (`TrainConfig`, `train`)
  distill   a small Llama draft cut from the target and distilled by KL, saved in Hugging Face
            layout (`distill`, `draft_from_target`)

Draft heads (Medusa, MLP speculator, EAGLE) are defined in `jaxspec.heads` and trained with the
same trainer; `jaxspec train {medusa,mlp,eagle,draft-model}` runs the whole pipeline.
"""

from jaxspec.train.data import (DataConfig, DataError, Dataset, read_prompt_file, read_prompts,
                                write_dataset)
from jaxspec.train.distill import DraftLM, distill, distill_loss, draft_from_target
from jaxspec.train.trainer import TrainConfig, make_optimizer, train

__all__ = ["DataConfig", "DataError", "Dataset", "DraftLM", "TrainConfig", "distill",
           "distill_loss", "draft_from_target", "make_optimizer", "read_prompt_file",
           "read_prompts", "train", "write_dataset"]
