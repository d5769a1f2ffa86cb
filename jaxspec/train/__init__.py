"""Training drafts on the target's own outputs (self-distillation), as library functions.

  fit       `train_head(target, kind, data, ...)`: create and train a Medusa, MLP or EAGLE head
            on any iterable of batches, with your optax optimizer, loss (`heads.Objective`),
            callbacks and mesh; returns a `TrainedHead` (drafter, save)
  distill   a small Llama draft cut from the target and distilled by KL, saved in Hugging Face
            layout (`distill`, `draft_from_target`)
  pard      PARD's mask-token objective (`PardObjective`, `distill(objective=...)`): a draft
            that proposes k tokens from one pass (`jaxspec.drafters.ParallelDraft`)
  trainer   the training loop under both: any NNX module, any optax optimizer, `TrainData`
            (exact resume) or any iterable of batches, orbax checkpoints (`TrainConfig`, `train`)
  online    the frozen target's hidden states computed inside the jitted step
            (`with_hidden_states`, `target_hidden`): no hidden-state store needed
  mesh      data-parallel training with the target sharded by the rules (`train_head(mesh=)`)
  corpus    the target writes multi-turn conversations to a token budget as token-id shards,
            read back as packed batches one shard at a time (`write_corpus`, `PackedCorpus`)
  data      prompt files -> the target writes responses -> tokens, loss masks and (optionally)
            the target's hidden states stored as memory-mapped .npy arrays (`write_dataset`,
            `Dataset`)
  export    heads to and from vLLM's formats (speculators EAGLE-3, Medusa, mlp_speculator)

`jaxspec train {medusa,mlp,eagle,draft-model,pard}` runs the whole pipeline through these functions.
"""

from jaxspec.train.corpus import (Corpus, CorpusConfig, PackedCorpus, write_corpus,
                                  write_corpus_dataset)
from jaxspec.train.data import (DataConfig, DataError, Dataset, read_prompt_file, read_prompts,
                                write_dataset)
from jaxspec.train.distill import DraftLM, distill, distill_loss, draft_from_target
from jaxspec.train.fit import TrainedHead, train_head
from jaxspec.train.online import target_hidden, with_hidden_states
from jaxspec.train.pard import PardObjective, pard_layout, pard_loss
from jaxspec.train.trainer import Callback, TrainConfig, TrainData, make_optimizer, train

__all__ = ["Callback", "Corpus", "CorpusConfig", "DataConfig", "DataError", "Dataset",
           "DraftLM", "PackedCorpus", "PardObjective", "TrainConfig", "TrainData", "TrainedHead",
           "distill", "distill_loss", "draft_from_target", "make_optimizer", "pard_layout",
           "pard_loss", "read_prompt_file", "read_prompts", "target_hidden", "train",
           "train_head", "with_hidden_states", "write_corpus", "write_corpus_dataset",
           "write_dataset"]
