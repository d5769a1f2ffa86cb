"""Training drafts on the target's own outputs (self-distillation).

  data      prompt files -> the target writes responses -> tokens, loss masks and the target's
            hidden states stored as memory-mapped .npy arrays (`write_dataset`, `Dataset`)
  trainer   AdamW training of any Flax NNX module with orbax checkpoints that resume exactly
            (`TrainConfig`, `train`)
  corpus    the target writes multi-turn conversations to a token budget as token-id shards,
            read back as packed batches one shard at a time (`write_corpus`, `PackedCorpus`)
  distill   a small Llama draft cut from the target and distilled by KL, saved in Hugging Face
            layout (`distill`, `draft_from_target`)

Draft heads (Medusa, MLP speculator, EAGLE) are defined in `jaxspec.heads` and trained with the
same trainer; `jaxspec train {medusa,mlp,eagle,draft-model}` runs the whole pipeline.
"""

from jaxspec.train.corpus import (Corpus, CorpusConfig, PackedCorpus, write_corpus,
                                  write_corpus_dataset)
from jaxspec.train.data import (DataConfig, DataError, Dataset, read_prompt_file, read_prompts,
                                write_dataset)
from jaxspec.train.distill import DraftLM, distill, distill_loss, draft_from_target
from jaxspec.train.trainer import TrainConfig, make_optimizer, train

__all__ = ["Corpus", "CorpusConfig", "DataConfig", "DataError", "Dataset", "DraftLM",
           "PackedCorpus", "TrainConfig", "distill", "distill_loss", "draft_from_target",
           "make_optimizer", "read_prompt_file", "read_prompts", "train", "write_corpus",
           "write_corpus_dataset", "write_dataset"]
