"""The ``decode-cpu-peers`` suite: FIA decode on the CPU (contiguous and paged KV) against its peers at their
strongest, on one and two threads, alone and beside a CPU-bound process.

Peers, each on the same keys and values laid out as it takes them (made outside the timing; int8 KV: the values
dequantized in the query dtype):

* ``sdpa-folded``: ``scaled_dot_product_attention`` with the GQA group folded into the query rows, ``q [B, N2,
  G, D]`` against ``K/V [B, N2, S, D]``: a reshape with the same result, each KV head read once;
* ``sdpa-gathered``: SDPA with ``enable_gqa`` on ``[B, N1, 1, D]`` queries (for reference);
* ``flex-folded``: ``torch.compile``'d ``flex_attention`` on the folded query (forward);
* ``ort-gqa``: onnxruntime's ``GroupQueryAttention`` (``com.microsoft``, CPU provider, fp32/fp16) when
  onnxruntime and onnx are installed (``pip install attnops[peers]``): the cache in its own ``[B, N2, S, D]``
  buffers bound as both past and present (no copy of the cache per call), the call adding the last token;
* ``attnops-1t``: attnops on one thread, in the two-thread cases (ratio ``attnops-1t / attnops``: what the second
  thread gains);
* ``read-bandwidth`` (not a peer): ``torch.sum`` over as many bytes as the KV on the case's threads (ratio
  ``read-bandwidth / attnops``: the fraction of the machine's read bandwidth attnops reaches; a peer can be beaten
  by at most its own time over this one).

The case's ``threads`` parameter is the thread count every implementation runs with (the runner sets it before
each call); ``beside_load`` the number of CPU-bound processes running meanwhile (:func:`.timing.busy_processes`).
"""
from __future__ import annotations

import torch

from .types import Case, Inputs, Runnable, Unavailable

SHAPES = ((1, 32768), (8, 4096))
KV_KINDS = (("float32", None), ("bfloat16", None), ("float16", None), ("bfloat16", "int8"))
PEERS = ("sdpa-folded", "sdpa-gathered", "flex-folded", "ort-gqa")


def peer_cases() -> tuple[Case, ...]:
    """FIA decode, N1=32, N2=8, D=128, one query token: B=1 x 32k and B=8 x 4k, fp32/bf16/fp16 and int8 KV (bf16
    query, per-channel antiquant), contiguous and paged (128-token pages, shuffled), on 1 and 2 threads; and bf16
    on 2 threads beside a CPU-bound process."""
    cases = []
    for batch, skv in SHAPES:
        for dtype, kv in KV_KINDS:
            tag = f"{dtype}-int8kv" if kv else dtype
            for pages in ("dense", "shuffled"):
                for threads, load in ((1, 0), (2, 0), (2, 1)):
                    if load and (kv or dtype != "bfloat16"):
                        continue
                    cases.append(Case(
                        name=f"decode-b{batch}-kv{skv}-{tag}-{pages}-t{threads}" + ("-beside-load" if load else ""),
                        op="fia_decode", batch=batch, heads=32, kv_heads=8, sq=1, skv=skv, d=128, dv=128,
                        dtype=dtype, baselines=PEERS + ("read-bandwidth",) + (("attnops-1t",) if threads > 1 else ()),
                        params={"pages": pages, "block_size": 128, "threads": threads, "beside_load": load,
                                **({"kv": kv} if kv else {})}))
    return tuple(cases)


def _contiguous_kv(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, N2, S, D]`` (BSND inputs transposed, contiguous)."""
    return tuple(t.transpose(1, 2).contiguous() for t in (inp.k, inp.v))


def _folded_query(case: Case, inp: Inputs) -> torch.Tensor:
    """The query ``[B, N2, G, D]`` (one query token: head ``n2 * G + g`` is row ``g`` of KV head ``n2``)."""
    if case.sq != 1:
        raise Unavailable("the folded peers take one query token")
    return inp.q.reshape(case.batch, case.kv_heads, case.heads // case.kv_heads, case.d)


def _unfold(out: torch.Tensor | None, case: Case) -> torch.Tensor | None:
    """A folded output ``[B, N2, G, Dv]`` as ``[B, N1, 1, Dv]`` (what the runner compares)."""
    return None if out is None else out.reshape(case.batch, case.heads, 1, case.dv)


def build_sdpa_folded(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    import torch.nn.functional as F

    q, (k, v) = _folded_query(case, inp), _contiguous_kv(inp)
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = F.scaled_dot_product_attention(q, k, v, scale=inp.scale)
    return Runnable(run, output=lambda: _unfold(state.get("out"), case))


def build_flex_folded(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        raise Unavailable(f"FlexAttention not available: {e}") from None
    q, (k, v) = _folded_query(case, inp), _contiguous_kv(inp)
    compiled = torch.compile(flex_attention)
    state = {}

    def run():
        with torch.no_grad():
            state["out"] = compiled(q, k, v, scale=inp.scale)
    try:  # the compile, outside the timing; a backend that cannot compile it makes the peer unavailable
        run()
    except Exception as e:  # noqa: BLE001 - inductor raises many types
        raise Unavailable(f"flex_attention does not compile here: {str(e).splitlines()[0][:200]}") from None
    return Runnable(run, output=lambda: _unfold(state.get("out"), case))


def build_ort_gqa(case: Case, inp: Inputs, device: torch.device) -> Runnable:
    """onnxruntime's GroupQueryAttention over the cache (see the module docstring)."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        raise Unavailable("onnxruntime and onnx are not installed (pip install attnops[peers])") from None
    if device.type != "cpu":
        raise Unavailable("the onnxruntime peer runs on the CPU provider")
    types = {torch.float32: (TensorProto.FLOAT, np.float32), torch.float16: (TensorProto.FLOAT16, np.float16)}
    if inp.q.dtype not in types:
        raise Unavailable(f"onnxruntime's CPU GroupQueryAttention takes fp32 and fp16, not {inp.q.dtype}")
    onnx_type, np_type = types[inp.q.dtype]
    b, n1, n2, d, s = case.batch, case.heads, case.kv_heads, case.d, case.skv
    k, v = _contiguous_kv(inp)  # [B, N2, S, D]: the past (the first S - 1 tokens) and room for the new one
    feeds = {"query": inp.q.reshape(b, 1, n1 * d), "key": inp.k[:, -1:].reshape(b, 1, n2 * d),
             "value": inp.v[:, -1:].reshape(b, 1, n2 * d)}
    io = [helper.make_tensor_value_info(name, onnx_type, list(t.shape)) for name, t in feeds.items()]
    io += [helper.make_tensor_value_info(name, onnx_type, [b, n2, s, d]) for name in ("past_key", "past_value")]
    io += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
           helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outs = [helper.make_tensor_value_info("output", onnx_type, [b, 1, n1 * d])]
    outs += [helper.make_tensor_value_info(name, onnx_type, [b, n2, s, d]) for name in ("present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", [i.name for i in io], [o.name for o in outs], domain="com.microsoft",
                            num_heads=n1, kv_num_heads=n2, scale=inp.scale)
    model = helper.make_model(helper.make_graph([node], "decode", io, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = case.params.get("threads", torch.get_num_threads())
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime's own error types
        raise Unavailable(f"onnxruntime: {str(e).splitlines()[0][:200]}") from None
    arrays = {name: t.contiguous().numpy().astype(np_type) for name, t in feeds.items()}
    cache = {name: ort.OrtValue.ortvalue_from_numpy(t.numpy().astype(np_type)) for name, t in
             (("key", k), ("value", v))}
    binding = session.io_binding()
    binding.bind_output("output")  # output 0
    for name, array in arrays.items():
        binding.bind_cpu_input(name, array)
    for which in ("key", "value"):  # the same buffer as past and present: the call writes the new token only
        binding.bind_ortvalue_input(f"past_{which}", cache[which])
        binding.bind_ortvalue_output(f"present_{which}", cache[which])
    binding.bind_cpu_input("seqlens_k", np.full(b, s - 1, dtype=np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(s, dtype=np.int32))

    def run():
        session.run_with_iobinding(binding)

    def output():
        out = torch.from_numpy(binding.copy_outputs_to_cpu()[0].astype(np.float32))
        return out.view(b, 1, n1, d).transpose(1, 2)
    try:
        run()
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"onnxruntime: {str(e).splitlines()[0][:200]}") from None
    return Runnable(run, output=output)

