"""Routing replay for Mixture-of-Experts policies: the trainer routes each token to the experts the
sampler chose for it, instead of choosing again.

The sampler and the trainer compute a token's router logits in different kernels, precisions and
batch layouts, so near-ties between experts break differently: the same weights then give a
different distribution, and the importance ratio pi_trainer / pi_sampler moves for a reason no
optimiser step caused. Replaying the sampler's routes removes that part of the mismatch ("rollout
routing replay", R3: W. Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", 2025; verl, slime and SkyRL ship it).

How, for the routers whose forward has transformers' contract `forward(hidden) -> (router_logits,
weights, indices)` and whose weights are a known function of the logits at the chosen experts
(`REPLAY_WEIGHTS`: softmax-then-top-k, DeepSeek-V3's sigmoid with bias-corrected group-limited choice,
DeepSeek-V2's scaled softmax, top-k-of-logits-then-softmax, each family's classes found by comparing
their forward's source; and one-class families: Jamba, Ernie 4.5, Mistral 4, MiniMax-M2, HunYuan-V3,
LFM2-MoE, Cohere2-MoE, Phi-3.5-MoE's sparsemixer), and for Llama 4's router, which returns dense
scores and the logits (`DENSE_SCORE_ROUTERS`):

- recording: while the engine generates, each router's chosen experts are kept per forward call;
  `RouteState.assemble` lays them out per row as `Rollout.prompt_routes` [N, P, layers, k] and
  `Rollout.completion_routes` [N, C, layers, k] (int16; -1: not recorded, route freely);
- replaying: a forward given routes (`replay(model, routes, valid)`, [b, t, layers, k] in that
  forward's token order) keeps the router's logits (so its load-balancing loss is unchanged) and
  replaces its choice by the recorded one; the weights of the chosen experts are the router's own
  function of its current logits gathered at them (a choice-only bias, such as DeepSeek-V3's
  `e_score_correction_bias`, does not enter them), so gradients reach the router.

The state is set before each forward and stays set until the next one, so that a checkpointed
layer recomputed in the backward pass routes as its forward did.
"""

from __future__ import annotations

import weakref

import torch

from rlft.errors import ConfigError


def _softmax_topk(router, logits, chosen):
    """softmax(logits) at the chosen experts, renormalised when `norm_topk_prob` (Mixtral's and
    Qwen3.5's routers always renormalise: no such attribute)."""
    top = torch.softmax(logits, dim=-1).gather(-1, chosen)
    return top / top.sum(dim=-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else top


def _sigmoid_group(router, logits, chosen):
    """DeepSeek-V3's router (and its copies): sigmoid(logits) at the chosen experts (the choice adds
    `e_score_correction_bias` and limits groups; the weights do not), renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`."""
    top = torch.sigmoid(logits).gather(-1, chosen)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


def _softmax_scaled(router, logits, chosen):
    """DeepSeek-V2's router: softmax(logits) at the chosen experts times `routed_scaling_factor`
    (greedy or group-limited choice; no renormalisation)."""
    return torch.softmax(logits, dim=-1).gather(-1, chosen) * router.routed_scaling_factor


def _topk_logits_softmax(router, logits, chosen):
    """gpt-oss's and Granite-MoE's routers: a softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(-1, chosen), dim=-1)


def _softmax_plain(router, logits, chosen):
    """Jamba's router: softmax(logits) at the chosen experts, not renormalised."""
    return torch.softmax(logits, dim=-1).gather(-1, chosen)


def _softmax_clamped(router, logits, chosen):
    """Ernie 4.5's router: softmax(logits) at the chosen experts (the choice adds its `moe_statics` bias;
    the weights do not), renormalised by their sum clamped at `norm_min`."""
    top = torch.softmax(logits, dim=-1).gather(-1, chosen)
    return top / top.sum(dim=-1, keepdim=True).clamp(min=router.norm_min)


def _softmax_group(router, logits, chosen):
    """Mistral 4's router: softmax(logits) at the chosen experts (group-limited choice), renormalised
    when `norm_topk_prob`, times `routed_scaling_factor`."""
    top = torch.softmax(logits, dim=-1).gather(-1, chosen)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


def _sigmoid_renormalised(router, logits, chosen):
    """MiniMax-M2's router: sigmoid(logits) at the chosen experts (the choice adds the block's
    `e_score_correction_bias`), renormalised."""
    top = torch.sigmoid(logits).gather(-1, chosen)
    return top / top.sum(dim=-1, keepdim=True)


def _sigmoid_hy(router, logits, chosen):
    """HunYuan-V3's router: as MiniMax-M2's, with an epsilon, times `router_scaling_factor`."""
    top = torch.sigmoid(logits).gather(-1, chosen)
    return top / (top.sum(dim=-1, keepdim=True) + 1e-20) * router.router_scaling_factor


def _sigmoid_lfm2(router, logits, chosen):
    """LFM2-MoE's router: sigmoid(logits) at the chosen experts (the choice adds `expert_bias` when
    `use_expert_bias`), renormalised when `norm_topk_prob`, times `routed_scaling_factor`."""
    top = torch.sigmoid(logits).gather(-1, chosen)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-6)
    return top * router.routed_scaling_factor


def _cohere2(router, logits, chosen):
    """Cohere2-MoE's router: its `expert_selection_fn` over the chosen experts' logits: a softmax, or a
    sigmoid renormalised when `norm_topk_prob`."""
    top = logits.gather(-1, chosen)
    if router.expert_selection_fn == "softmax":
        return torch.softmax(top, dim=-1)
    top = torch.sigmoid(top)
    return top / top.sum(dim=-1, keepdim=True) if router.norm_topk_prob else top


def _sparsemixer(router, logits, chosen):
    """Phi-3.5-MoE's router (sparsemixer, L. Liu et al. 2024, arXiv:2409.12136) at the values its eval-mode
    forward computes: for the j-th chosen expert, the softmax over the logits still in play (the earlier
    chosen ones set to -inf) that lie within 2 x `router_jitter_noise` of their largest, relative to
    max(|logit|, that largest), taken at that expert. Its training-mode forward samples its choice and
    scales a weight by 1/3 at random (Heun's third-order estimate of the routing gradient); a replayed
    choice is given, so its weights are these values and their gradient the softmax's."""
    in_play, weights = logits, []
    for j in range(chosen.shape[-1]):
        with torch.no_grad():
            top = in_play.max(dim=-1, keepdim=True).values
            far = (top - logits) / logits.abs().clamp(min=top) > 2 * router.router_jitter_noise
        gates = torch.softmax(in_play.masked_fill(far, float("-inf")), dim=-1)
        weights.append(gates.gather(-1, chosen[:, j:j + 1]))
        in_play = in_play.scatter(-1, chosen[:, j:j + 1], float("-inf"))
    return torch.cat(weights, dim=-1)


def _sigmoid_route_scale(router, logits, chosen):
    """AFMoE's router: sigmoid(logits) at the chosen experts (the choice adds the block's `expert_bias`),
    renormalised, times `route_scale`."""
    top = torch.sigmoid(logits).gather(-1, chosen)
    return top / (top.sum(dim=-1, keepdim=True) + 1e-20) * router.route_scale


def _score_fn_renormalised(router, logits, chosen):
    """DeepSeek-V4's routers (top-k, and hash: a fixed token -> experts table chooses): its `score_fn`
    (the config's `scoring_func`) at the chosen experts, renormalised, times `routed_scaling_factor`."""
    top = router.score_fn(logits).gather(-1, chosen)
    return top / (top.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor


def _gemma4(router, probabilities, chosen):
    """Gemma 4's router (its first output is softmax probabilities, not logits): the probabilities at the
    chosen experts, renormalised, times `per_expert_scale` at them."""
    top = probabilities.gather(-1, chosen)
    return top / top.sum(dim=-1, keepdim=True) * router.per_expert_scale[chosen]


def _softmax_pnorm(block, logits, chosen):
    """DBRX's (its FFN block chooses: `route_tokens_to_experts`): softmax(logits) at the chosen experts,
    divided by their p-norm, p = `moe_normalize_expert_weights` (None: as they are)."""
    top = torch.softmax(logits, dim=-1).gather(-1, chosen)
    p = block.moe_normalize_expert_weights
    return top if p is None else top / torch.norm(top, p=p, dim=-1, keepdim=True)


# transformers' router classes whose recorded choice rlft replays, by how their weights follow from the
# logits (each family's classes have the same forward source, transformers 5.24, but for a few computed
# alike in other code: Step-3.7's as MiniMax-M2's without a bias argument, Longcat-Flash's as DeepSeek-V2's
# in float32, DeepSeek-V4's hash router as its top-k one with a fixed choice)
_FAMILIES = {
    _softmax_topk: """Qwen2MoeTopKRouter Qwen3MoeTopKRouter Qwen3NextTopKRouter
        Qwen3OmniMoeThinkerTextTopKRouter Qwen3OmniMoeTalkerTextTopKRouter OlmoeTopKRouter FlexOlmoTopKRouter
        MixtralTopKRouter MiniMaxTopKRouter MellumTopKRouter Qwen4ExpTextTopKRouter Qwen3_5MoeTopKRouter
        Qwen3OmniMoeTextTopKRouter Qwen3VLMoeTextTopKRouter""",
    _sigmoid_group: """DeepseekV3TopkRouter DeepseekV32TopkRouter AXK1TopkRouter BailingHybridTopkRouter
        Dots1TopkRouter Dots3NoteTextTopkRouter ExaoneMoeTopkRouter Glm4MoeTopkRouter Glm4MoeLiteTopkRouter
        Glm4vMoeTextTopkRouter Glm5NextTextTopkRouter GlmMoeDsaTopkRouter HYV4TopkRouter HYV4VLTopkRouter
        KimiLinearTopkRouter MiMoV2FlashTopkRouter NemotronHTopkRouter SolarOpenTopkRouter""",
    _softmax_scaled: """DeepseekV2TopkRouter DeepseekOcr2TextTopkRouter UnlimitedOcrTextTopkRouter
        LongcatFlashTopkRouter""",
    _topk_logits_softmax: """GptOssTopKRouter GraniteMoeTopKRouter GraniteMoeSWATopKRouter
        GraniteMoeHybridTopKRouter GraniteMoeSharedTopKRouter AriaTextTopKRouter""",
    _softmax_plain: "JambaTopKRouter",
    _softmax_clamped: "Ernie4_5_MoeTopKRouter",
    _softmax_group: "Mistral4TopkRouter",
    _sigmoid_renormalised: "MiniMaxM2TopKRouter Step3p7TopKRouter",
    _sigmoid_hy: "HYV3TopKRouter",
    _sigmoid_lfm2: "Lfm2MoeTopKRouter",
    _cohere2: "Cohere2MoeTopKRouter",
    _sparsemixer: "PhimoeTopKRouter",
    _softmax_pnorm: "DbrxFFN",
    _sigmoid_route_scale: "AfmoeTokenChoiceRouter",
    _score_fn_renormalised: "DeepseekV4TopKRouter DeepseekV4HashRouter",
    _gemma4: "Gemma4TextRouter",
}
REPLAY_WEIGHTS = {name: how for how, names in _FAMILIES.items() for name in names.split()}
# routers whose forward returns (dense scores [tokens, experts], logits) instead: Llama 4's (the sigmoid
# of the top-k logits, 0 elsewhere)
DENSE_SCORE_ROUTERS = frozenset({"Llama4Router"})
# MoE blocks whose router returns only its logits and whose block chooses, in a method
# `route_tokens_to_experts(logits) -> (weights, indices)` (DBRX): the block is hooked as the router
CHOOSING_BLOCKS = frozenset({"DbrxFFN"})


def experts_per_token(module: torch.nn.Module) -> int | None:
    """A router's k: its `top_k`, or its config's `top_k_experts` (Gemma 4's); None: not a top-k router."""
    k = getattr(module, "top_k", None)
    if k is None:
        k = getattr(getattr(module, "config", None), "top_k_experts", None)
    return None if k is None else int(k)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order: modules whose class name ends in "Router" and that choose k
    experts (`experts_per_token`: transformers' MoE routers), and the blocks that choose for theirs
    (`CHOOSING_BLOCKS`)."""
    return [m for m in model.modules() if experts_per_token(m) is not None and (
        type(m).__name__.lower().endswith("router") or type(m).__name__ in CHOOSING_BLOCKS)]


def unsupported_routers(model: torch.nn.Module) -> list[str]:
    """Names of the model's router classes that replay cannot run (sorted)."""
    return sorted({type(m).__name__ for m in moe_routers(model)} - set(REPLAY_WEIGHTS) - DENSE_SCORE_ROUTERS)


class RouteState:
    """What the routers of one model do in their next forward: route freely, record, or replay.
    Shared by the routers `install` hooked; `agree` / `compared` count (token, layer) pairs whose
    free choice equals the replayed one (the same set of experts), over the valid (completion)
    tokens of the forwards that train (gradient enabled; checks and old log-probs are not
    counted)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.layers, self.top_k = len(routers), experts_per_token(routers[0])
        self.mode, self.routes, self.valid, self.armed = "free", None, None, None
        self.calls: list[tuple[int, int]] = []  # record: (rows, tokens) of each forward
        self.recorded: list[list[torch.Tensor]] = [[] for _ in routers]
        self.agree = self.compared = 0.0
        self.said_missing = False  # (a sampler that reported too few routes was warned about)

    def record(self) -> None:
        self.mode, self.routes, self.valid = "record", None, None
        self.calls, self.recorded = [], [[] for _ in range(self.layers)]

    def free(self) -> None:
        self.mode, self.routes, self.valid = "free", None, None
        self.calls, self.recorded = [], [[] for _ in range(self.layers)]

    def assemble(self, rows: int, prompt_width: int, completion_width: int):
        """The recorded routes of a generation as (prompt_routes [rows, P, L, k], completion_routes
        [rows, C, L, k]), int16, -1 where no forward read the position (the last completion token).
        Forward calls fill positions left to right; a call over fewer rows (a prompt prefilled once
        for its group) is repeated to `rows`."""
        out = torch.full((rows, prompt_width + completion_width, self.layers, self.top_k), -1,
                         dtype=torch.int16)
        column = 0
        for chosen in self.take_calls():
            batch, tokens = chosen.shape[:2]
            if batch != rows:
                chosen = chosen.repeat_interleave(rows // batch, dim=0)
            width = min(tokens, out.shape[1] - column)
            out[:, column:column + width] = chosen[:, :width]
            column += tokens
        return out[:, :prompt_width], out[:, prompt_width:]

    def take_calls(self) -> list[torch.Tensor]:
        """Each recorded forward's choices, [rows, tokens, L, k] int16 on the CPU, in call order; the
        state is freed."""
        out = []
        for call, (batch, tokens) in enumerate(self.calls):
            chosen = torch.stack([layer[call] for layer in self.recorded], dim=1)  # [batch*tokens, L, k]
            out.append(chosen.reshape(batch, tokens, self.layers, self.top_k).to("cpu", torch.int16))
        self.free()
        return out

    def take_counts(self) -> tuple[float, float]:
        """(replayed (token, layer) choices the router would have made itself, replayed choices)
        since the last call."""
        counts = (self.agree, self.compared)
        self.agree = self.compared = 0.0
        return counts

    def take_agreement(self) -> float | None:
        """The share of replayed choices the router would have made itself, since the last call
        (None: nothing replayed)."""
        agree, compared = self.take_counts()
        return agree / compared if compared else None


def _route(router: torch.nn.Module, inputs, output):
    """The forward hook on every router: records its choice, or replaces it by the recorded one.
    It reads its state and layer from the router itself, so a deep copy of the model (a frozen
    reference) records and replays on a state of its own."""
    state, layer = router._rlft_route_state, router._rlft_route_layer
    dense = type(router).__name__ in DENSE_SCORE_ROUTERS
    if dense:  # (scores [tokens, experts], logits); its choice: the top-k of the logits, as it takes it
        scores, logits = output
        indices = torch.topk(logits, router.top_k, dim=1).indices
    else:
        logits, scores, indices = output
    if state.mode == "record":
        state.recorded[layer].append(indices.detach())
        return None
    if state.mode != "replay":
        return None
    routes = state.routes[:, layer]  # [tokens, k]
    if routes.shape[0] != indices.shape[0]:
        raise RuntimeError(f"routing replay: {routes.shape[0]} recorded positions for a forward of "
                           f"{indices.shape[0]} tokens (an rlft bug: the layouts differ)")
    recorded = routes[:, 0] >= 0
    chosen = torch.where(recorded[:, None], routes.long(), indices)
    if state.valid is not None and torch.is_grad_enabled():  # counted in the training forwards
        compare = recorded & state.valid
        same = (chosen.sort(dim=-1).values == indices.sort(dim=-1).values).all(dim=-1)
        state.agree += float((same & compare).sum())
        state.compared += float(compare.sum())
    if dense:
        return torch.where(recorded[:, None], _dense_sigmoid(logits, chosen).to(scores.dtype), scores), logits
    # at least float32, as the routers compute it
    precision = torch.promote_types(logits.dtype, torch.float32)
    top = REPLAY_WEIGHTS[type(router).__name__](router, logits.to(precision), chosen)
    return logits, torch.where(recorded[:, None], top.to(scores.dtype), scores), chosen


def _dense_sigmoid(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Llama 4's router's scores for the experts `chosen`: sigmoid of their logits, 0 (sigmoid of
    -inf) at every other expert, as a dense [tokens, experts] matrix."""
    scattered = torch.full_like(logits, float("-inf")).scatter(1, chosen, logits.gather(1, chosen))
    return torch.sigmoid(scattered.float())


def attach(router: torch.nn.Module, layer: int, state: RouteState) -> None:
    """Make `router` (layer `layer` of a model) record and replay through `state`."""
    router._rlft_route_state, router._rlft_route_layer = state, layer
    if type(router).__name__ in CHOOSING_BLOCKS:
        _hook_choice(type(router))
    else:
        router.register_forward_hook(_route)


def _hook_choice(block_class: type) -> None:
    """A choosing block's `route_tokens_to_experts` through `_route` (once per class): the same choice
    and weights for a block no state was attached to; each attached block (a deep copy's too) its own."""
    if getattr(block_class.route_tokens_to_experts, "_rlft_routed", False):
        return
    choose = block_class.route_tokens_to_experts

    def routed(block, router_logits):
        weights, indices = choose(block, router_logits)
        if "_rlft_route_state" not in vars(block):
            return weights, indices
        out = _route(block, (router_logits,), (router_logits, weights, indices))
        return (weights, indices) if out is None else (out[1], out[2])
    routed._rlft_routed = True
    block_class.route_tokens_to_experts = routed


def _count(model, args, kwargs) -> None:
    """The forward pre-hook on the model: in record mode, the rows and tokens of each call. In
    replay mode it consumes the arming `replay` gave: a forward of the shape armed replays (and the
    state stays set for checkpointed layers recomputed in the backward, which rerun layers, not
    this forward); any other forward of the model (a callback's generate, beams) routes freely."""
    state = model._rlft_routes
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
    shape = (int(ids.shape[0]), int(ids.shape[1]))
    if state.mode == "record":
        state.calls.append(shape)
    elif state.mode == "replay":
        if state.armed != shape:
            state.free()
        state.armed = None


def install(model: torch.nn.Module) -> RouteState:
    """Hook the routers of `model` (a transformers MoE model, before any wrapper) for recording and
    replay; returns their shared state (also `model._rlft_routes`). Idempotent."""
    state = vars(model).get("_rlft_routes")
    if state is not None:
        return state
    routers = moe_routers(model)
    if not routers:
        raise ConfigError(f"routing_replay='rollout': {type(model).__name__} has no "
                          "Mixture-of-Experts router; leave routing_replay at auto (dense models "
                          "record nothing)")
    unsupported = unsupported_routers(model)
    if unsupported:
        raise ConfigError(f"routing_replay='rollout': the routers {unsupported} are not replayable "
                          f"yet (rlft replays {len(REPLAY_WEIGHTS) + len(DENSE_SCORE_ROUTERS)} router "
                          "classes: softmax-top-k, DeepSeek-V3's sigmoid, DeepSeek-V2's scaled softmax, "
                          "top-k-of-logits softmax, Llama 4's; docs/moe.md lists them); set "
                          "routing_replay: none")
    state = RouteState(routers)
    for layer, router in enumerate(routers):
        attach(router, layer, state)
    model._rlft_routes = state
    model.register_forward_pre_hook(_count, with_kwargs=True)
    _FOUND.clear()  # a wrapper looked up before may now find it
    return state


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its state (or None)


def route_state(model) -> RouteState | None:
    """The state `install` attached to `model` or to a module inside its wrappers (DDP, peft)."""
    if model not in _FOUND:
        _FOUND[model] = next((vars(m)["_rlft_routes"] for m in model.modules() if "_rlft_routes" in vars(m)),
                             None)
    return _FOUND[model]


def extend_first_reads(routes: list, read: torch.Tensor, decoded: torch.Tensor, value=lambda t: t) -> None:
    """A row sampled in several generate calls (the turns of a tool loop, the windows of partial rollouts)
    keeps each completion token's route from the call that first read it. `routes`: one entry per
    completion token so far (None: no call has read it yet: the last token of a call, tool output);
    `read` [n, L, k]: this call's prefill routes of those tokens, which fill the unread ones; `decoded`
    [m, L, k]: its decoding's routes of the m tokens it sampled, appended (None where not read). `value`
    turns a [L, k] tensor into what `routes` holds (a nested list to keep it JSON)."""
    for j, route in enumerate(routes):
        if route is None:
            routes[j] = value(read[j])
    routes += [None if bool((step < 0).all()) else value(step) for step in decoded]


def replay(model, routes: torch.Tensor | None, valid: torch.Tensor | None = None) -> None:
    """Before a forward of `model`: route by `routes` [b, t, L, k] (the forward's tokens in order;
    -1: free), comparing with the free choice where `valid` [b, t]; None: route freely. No-op for a
    model without replay."""
    state = route_state(model)
    if state is None:
        return
    if routes is None:
        state.free()
        return
    if routes.shape[-2:] != (state.layers, state.top_k):
        raise RuntimeError(f"routing replay: routes for {tuple(routes.shape[-2:])} (layers, "
                           f"top_k), the model has ({state.layers}, {state.top_k})")
    state.mode, state.armed = "replay", (int(routes.shape[0]), int(routes.shape[1]))
    state.routes = routes.reshape(-1, state.layers, state.top_k)
    state.valid = None if valid is None else valid.reshape(-1).bool().to(routes.device)


def resolve(mode: str, model, engine_records: bool) -> tuple[bool, str | None]:
    """Whether to replay (`routing_replay` `mode` for `model`), and a note to say: auto replays a
    MoE policy whose routers are replayable when the engine records routes (transformers'
    generate or vLLM, in the trainer's process or the async producer; not rollout_func)."""
    if mode == "none":
        return False, None
    routers = moe_routers(model)
    if mode == "rollout":
        if not engine_records:
            raise ConfigError("routing_replay='rollout' needs routes recorded by the rollout "
                              "engine: transformers' generate and vLLM (colocated, or a server started "
                              "by `rlft vllm-serve`) record them, rollout_func does not; set "
                              "routing_replay: none")
        return True, None
    if not routers:
        return False, None
    unsupported = unsupported_routers(model)
    if unsupported or not engine_records:
        why = (f"its routers {unsupported} are not replayable yet" if unsupported else
               "this rollout engine does not record routes yet")
        return False, (f"routing replay is off for this Mixture-of-Experts policy: {why}, so the "
                       "trainer may route tokens to other experts than the sampler did (the "
                       "sampling/ metrics measure the mismatch)")
    return True, None
