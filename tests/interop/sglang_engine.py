"""Run inside the SGLang virtualenv (scripts/interop_venvs.sh), never with moeplace's own venv: SGLang's own
``compute_initial_expert_location_metadata`` applied to a moeplace export. Called by tests/test_interop_engines.py.

  init MODEL_DIR EXPORT.json EP_SIZE REDUNDANT   loads EXPORT.json as ``--init-expert-location`` on every EP rank
                                                 of the model in MODEL_DIR (a config.json) and prints, as JSON,
                                                 the layer count SGLang expects and the maps it built per rank
  record MODEL_DIR EXPORT.json EP_SIZE REDUNDANT MODE OUT_DIR
                                                 SGLang's expert-distribution recorder in MODE (per_token or
                                                 stat) over a fixed schedule of forward passes (EXTEND, DECODE,
                                                 MIXED, IDLE) of random router logits, routed by SGLang's own
                                                 select_experts with dynamic dispatch over the replicas of
                                                 EXPORT.json; writes the recorder's dump (dump_record) and the
                                                 logits (logits.npz) to OUT_DIR and prints the schedule as JSON

The recorder, the top-k, the logical->physical dispatch, the ForwardBatch and the dump are SGLang's; only the
model around them is missing: each MoE layer's router logits are random numbers instead of a gate's output.
Two CPU adjustments: top-k runs SGLang's torch-native path (``TopKConfig(torch_native=True)``; ``fused_topk``
needs a GPU kernel), and the stat gatherer's device lookup (``get_device``, accelerators only) returns "cpu".
"""

from __future__ import annotations

import json
import sys


def init(model_dir: str, export: str, ep_size: int, redundant: int) -> dict:
    import sglang
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation, compute_initial_expert_location_metadata
    from sglang.srt.runtime_context import get_context

    ranks = []
    with get_context().override_server_args(model_path=model_dir, tp_size=ep_size, ep_size=ep_size,
                                            ep_num_redundant_experts=redundant, init_expert_location=export,
                                            device="cpu", ep_dispatch_algorithm="static"):
        mc = ModelConfig(model_path=model_dir)
        want = ModelConfigForExpertLocation.from_model_config(mc)
        for rank in range(ep_size):
            md = compute_initial_expert_location_metadata(mc, moe_ep_rank=rank)
            ranks.append({"physical_to_logical_map": md.physical_to_logical_map.tolist(),
                          "logical_to_all_physical_map": md.logical_to_all_physical_map.tolist(),
                          "num_valid": md.logical_to_all_physical_map_num_valid.tolist(),
                          "dispatch": md.logical_to_rank_dispatch_physical_map.tolist()})
    return {"sglang": sglang.__version__, "num_layers": want.num_layers,
            "num_logical_experts": want.num_logical_experts, "ranks": ranks}


# (forward mode, per-sequence token counts) of each pass; EXTEND/MIXED: extend_seq_lens, others: tokens
SCHEDULE = [("EXTEND", [5, 3]), ("DECODE", [1, 1]), ("MIXED", [4, 1, 1]), ("IDLE", []), ("DECODE", [1, 1, 1])]


def record(model_dir: str, export: str, ep_size: int, redundant: int, mode: str, out_dir: str) -> dict:
    from pathlib import Path

    import numpy as np
    import sglang
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_distribution as ed
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_context

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.distributed.is_initialized():  # the stat dump all-reduces over ranks: one gloo rank here
        torch.distributed.init_process_group("gloo", init_method=f"file://{out / '.pg'}", rank=0, world_size=1)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    k, first_dense = cfg["num_experts_per_tok"], cfg["first_k_dense_replace"]
    # SGLang's stat gatherer asks sglang.srt.utils.get_device() for an accelerator and has no CPU fallback (the
    # per_token gatherer uses the configured device); point that one lookup at the CPU, nothing else changes
    ed.get_device = lambda device_id=None: "cpu"
    gen = torch.Generator().manual_seed(0)
    logits_of_pass, schedule = [], []
    with get_context().override_server_args(model_path=model_dir, tp_size=ep_size, ep_size=ep_size,
                                            ep_num_redundant_experts=redundant, init_expert_location=export,
                                            device="cpu", ep_dispatch_algorithm="dynamic",
                                            expert_distribution_recorder_mode=mode,
                                            expert_distribution_recorder_buffer_size=8, chunked_prefill_size=64):
        mc = ModelConfig(model_path=model_dir)
        md = compute_initial_expert_location_metadata(mc, moe_ep_rank=0)
        set_global_expert_location_metadata(md, allow_overwrite=True)
        recorder = ed.ExpertDistributionRecorder.init_new(md, rank=0)
        ed.set_global_expert_distribution_recorder(recorder)
        topk_config = TopKConfig(top_k=k, renormalize=True, torch_native=True)  # fused_topk needs a GPU kernel
        recorder.start_record()
        pos0 = 100
        for pass_id, (mode_name, lens) in enumerate(SCHEDULE):
            T = sum(lens)
            fm = getattr(ForwardMode, mode_name)
            extend = fm in (ForwardMode.EXTEND, ForwardMode.MIXED)
            fb = ForwardBatch(forward_mode=fm, batch_size=len(lens), input_ids=torch.arange(T) % 7,
                              req_pool_indices=torch.arange(len(lens)), seq_lens=torch.tensor(lens),
                              out_cache_loc=torch.arange(T), seq_lens_sum=T,
                              positions=torch.arange(pos0, pos0 + T),
                              extend_seq_lens_cpu=list(lens) if extend else None)
            pos0 += T
            logits = torch.randn(T, md.num_layers, md.num_logical_experts, generator=gen)  # [T, Lm, E]
            physical = torch.full((T, md.num_layers, k), -1, dtype=torch.int32)
            with recorder.with_forward_pass(pass_id, fb):
                for layer in range(first_dense, md.num_layers):  # dense layers never reach select_experts
                    with recorder.with_current_layer(layer):
                        info = ExpertLocationDispatchInfo.init_new(layer_id=layer)
                        got = select_experts(torch.zeros(T, cfg["hidden_size"]), logits[:, layer].clone(),
                                             topk_config, layer_id=layer, expert_location_dispatch_info=info)
                        physical[:, layer] = got.topk_ids
            logits_of_pass.append(logits.numpy())
            schedule.append({"forward_mode": mode_name, "forward_mode_value": int(fm.value), "seq_lens": lens,
                             "physical": physical.tolist()})
        recorder.stop_record()
        import os
        os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = str(out)
        recorder.dump_record(output_mode="file")
    np.savez_compressed(out / "logits.npz", **{f"pass{i}": a for i, a in enumerate(logits_of_pass)})
    dumps = sorted(p.name for p in out.glob("expert_distribution_recorder_*.pt"))
    return {"sglang": sglang.__version__, "torch": torch.__version__, "mode": mode, "dumps": dumps,
            "first_dense": first_dense, "top_k": k, "num_layers": md.num_layers,
            "num_logical_experts": md.num_logical_experts, "num_physical_experts": md.num_physical_experts,
            "physical_to_logical_map": md.physical_to_logical_map.tolist(), "schedule": schedule}


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "init":
        print(json.dumps(init(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    elif cmd == "record":
        print(json.dumps(record(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
                                sys.argv[7])))
    else:
        sys.exit(f"unknown command {cmd!r}; expected init or record")
