"""Sharding and placement: logical-axis rules, meshes and sub-meshes, sharded models, a
drafter on its own mesh, device profiles and the placement planner.

    mesh = jaxspec.sharding.make_mesh({"data": 2, "model": 4})
    model = jaxspec.sharding.shard_model(jaxspec.load(), mesh)   # tensor x data parallel
    out = jaxspec.speculative_generate(model, "ngram", prompts)   # compiled for the mesh

    devs = jax.devices()
    placement = Placement(target=devs[:4], drafter=[devs[4]])     # host-orchestrated loop
    out = jaxspec.speculative_generate(model, drafter, prompts, placement=placement)
"""

from jaxspec.sharding.placement import Placement
from jaxspec.sharding.planner import Candidate, DrafterSpec, Plan, expected_tokens_per_step, plan
from jaxspec.sharding.profiles import (LinkProfile, ModelProfile, load_profiles, profile,
                                       profile_link, save_profiles)
from jaxspec.sharding.rules import (DEFAULT_RULES, ModelSharding, ShardingRules, check_fits,
                                    make_mesh, param_shardings, shard_model, shard_params,
                                    submesh)

__all__ = ["Candidate", "DEFAULT_RULES", "DrafterSpec", "LinkProfile", "ModelProfile",
           "ModelSharding", "Placement", "Plan", "ShardingRules", "check_fits",
           "expected_tokens_per_step", "load_profiles", "make_mesh", "param_shardings", "plan",
           "profile", "profile_link", "save_profiles", "shard_model", "shard_params", "submesh"]
