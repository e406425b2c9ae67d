"""Tool-calling rollouts with a scripted policy: schemas, parsing, execution, errors, masking, limits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from rlft.config import ConfigError
from rlft.rollout.multiturn import ToolLoop, Toolset
from rlft.rollout.tools import check_template, parse_turn, tool_schemas, tool_suffix_ids
from tests.tools_helpers import Scripted, add, call, explode, slow


@pytest.fixture(scope="module")
def tok(tiny_tool_dir):
    return AutoTokenizer.from_pretrained(tiny_tool_dir)


def prompt_ids(tok, text="What is 12+34?", tools=(add,)):
    return tok.apply_chat_template([{"role": "user", "content": text}], tools=tool_schemas(list(tools)),
                                   add_generation_prompt=True, tokenize=True, return_dict=False)


def loop(tok, script, tools=(add,), max_length=96, iterations=None, timeout=5.0, cut=False):
    engine = Scripted(tok, script, cut=cut)
    toolset = Toolset({t.__name__: t for t in tools}, tool_schemas(list(tools)))
    return ToolLoop(engine, tok, toolset, max_length, iterations, timeout), engine


def add_then_answer(context, turn):
    return call("add", a=12, b=34) if turn == 0 else "<answer>46</answer>"


def test_schema_comes_from_signature_and_docstring():
    (schema,) = tool_schemas([add])
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert schema["function"]["parameters"]["required"] == ["a", "b"]


def test_tool_without_docstring_is_refused_by_name():
    def mystery(x):
        return x

    with pytest.raises(ConfigError, match="tool 'mystery'.*type hint and a Google-style docstring"):
        tool_schemas([mystery])
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        tool_schemas([add, add])


def test_parsing_reads_hermes_calls_and_names_what_is_malformed(tok):
    ids = tok("Let me add." + call("add", a=1, b=2) + call("add", a="3", b=4), add_special_tokens=False)["input_ids"]
    content, calls = parse_turn(tok, ids + [tok.eos_token_id], [], [])
    assert content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                               ("add", {"a": "3", "b": 4}, None)]
    bad = {
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>': "not valid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': 'has no "name"',
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>': '"arguments" must be an object',
        '<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>': "arguments are not valid JSON",
        '<tool_call>{"name": "add"': "not closed",
    }
    for text, message in bad.items():
        _, calls = parse_turn(tok, tok(text, add_special_tokens=False)["input_ids"], [], [])
        assert len(calls) == 1 and message in calls[0].error, text
    string_args = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>'
    assert parse_turn(tok, tok(string_args, add_special_tokens=False)["input_ids"], [], [])[1][0].arguments == \
        {"a": 5, "b": 6}


def test_template_checks(tok, tiny_causal_dir):
    check_template(tok)
    plain = AutoTokenizer.from_pretrained(tiny_causal_dir)  # ChatML that renders only 'content'
    with pytest.raises(ConfigError, match="drops.*probe_tool_x"):
        check_template(plain)
    suffix = tok.decode(tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "46"}]))
    assert suffix == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_an_earlier_turn_still_gives_the_tool_suffix(tok):
    """Qwen3's template is not prefix-preserving: an assistant turn gets an empty think block only while it is the
    last message. What follows the turn's EOS is the same either way, so the suffix is found after the turn's EOS;
    a template whose tool messages cannot be found after that EOS is still refused."""
    import copy

    from rlft.tiny import TOOL_CHAT_TEMPLATE

    thinking = copy.deepcopy(tok)
    thinking.chat_template = TOOL_CHAT_TEMPLATE.replace(
        "\n{{ message['content'] or '' }}",
        "\n{% if message['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ message['content'] or '' }}")
    messages = [{"role": "tool", "name": "add", "content": "46"}]
    assert tool_suffix_ids(thinking, messages) == tool_suffix_ids(tok, messages)
    broken = copy.deepcopy(tok)  # ... and tool results glued into the turn, with no EOS of their own
    broken.chat_template = thinking.chat_template.replace(
        "<|im_end|>\n{% endfor %}", "{% if message['role'] != 'tool' %}<|im_end|>\n{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        tool_suffix_ids(broken, messages)


def test_call_runs_and_result_is_context_not_trained(tok):
    tools, engine = loop(tok, add_then_answer)
    prompt = prompt_ids(tok)
    out = tools(None, [prompt], 2)
    row = out.completion_ids[0][out.completion_mask[0].bool()].tolist()
    first = tok(call("add", a=12, b=34), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "46"}])
    last = tok("<answer>46</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row == first + suffix + last
    assert out.tool_mask[0, :len(row)].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(last)
    assert out.loss_mask.sum(1).tolist() == [len(first) + len(last)] * 2
    # generation continued from exactly the tokens produced (no re-tokenisation of the conversation)
    assert engine.calls[1] == [prompt + first + suffix] * 2
    assert engine.budgets == [None, 96 - len(first) - len(suffix)]  # a later turn gets what is left of the budget
    assert out.completions[0] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]},
        {"role": "tool", "name": "add", "content": "46"}, {"role": "assistant", "content": "<answer>46</answer>"}]
    assert {k: v.tolist() for k, v in out.stats.items()} == {"tool_calls": [1.0, 1.0], "tool_failures": [0.0, 0.0],
                                                               "turns": [2.0, 2.0], "hit_limit": [0.0, 0.0]}
    assert not out.truncated.any()


@pytest.mark.parametrize("text, error", [
    (call("nope", x=1), "unknown tool 'nope'; the tools are ['add', 'explode', 'slow']"),
    (call("explode", x=3), "explode raised RuntimeError: boom 3"),
    (call("add", a=1), "add raised TypeError"),
    (call("slow", x=1), "slow timed out after 0.3 s"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "the tool call is not valid JSON"),
])
def test_failures_become_tool_messages_and_are_counted(tok, text, error):
    tools, _ = loop(tok, lambda c, t: text if t == 0 else "<answer>0</answer>", tools=(add, explode, slow),
                    timeout=0.3, max_length=300)  # error messages are long in a 448-token vocabulary
    out = tools(None, [prompt_ids(tok, tools=(add, explode, slow))], 1)
    message = out.completions[0][1]
    assert message["role"] == "tool" and error in json.loads(message["content"])["error"]
    assert out.stats["tool_failures"].tolist() == [1.0] and out.stats["turns"].tolist() == [2.0]


def test_iteration_limit_stops_and_is_flagged(tok):
    tools, engine = loop(tok, lambda c, t: call("add", a=t, b=1), iterations=2)
    out = tools(None, [prompt_ids(tok)], 2)
    assert len(engine.calls) == 3  # first turn + two rounds of tool results
    assert out.stats["turns"].tolist() == [3.0, 3.0] and out.stats["tool_calls"].tolist() == [2.0, 2.0]
    assert out.stats["hit_limit"].tolist() == [1.0, 1.0]
    tools, engine = loop(tok, lambda c, t: call("add", a=t, b=1), iterations=0)
    assert tools(None, [prompt_ids(tok)], 1).stats["tool_calls"].tolist() == [0.0] and len(engine.calls) == 1


def test_completion_budget_counts_tool_output(tok):
    first = len(tok(call("add", a=12, b=34), add_special_tokens=False)["input_ids"]) + 1
    tools, engine = loop(tok, add_then_answer, max_length=first + 5)  # the tool result (16 tokens) does not fit
    out = tools(None, [prompt_ids(tok)], 1)
    assert len(engine.calls) == 1 and out.completion_mask.sum().item() == first
    assert out.stats["hit_limit"].tolist() == [1.0] and out.stats["tool_calls"].tolist() == [1.0]
    suffix = len(tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "46"}]))
    tools, _ = loop(tok, add_then_answer, max_length=first + suffix + 3)  # the answer is cut to 3 tokens
    out = tools(None, [prompt_ids(tok)], 1)
    assert out.completion_mask.sum().item() == first + suffix + 3 and out.truncated.tolist() == [True]


def test_cut_turn_calls_are_not_run(tok):
    tools, engine = loop(tok, add_then_answer, cut=True)
    out = tools(None, [prompt_ids(tok)], 1)
    assert len(engine.calls) == 1 and out.stats["tool_calls"].tolist() == [0.0] and out.truncated.tolist() == [True]


def test_rows_continue_independently(tok):
    def script(context, turn):  # the 12+34 prompt calls the tool, the other answers at once
        return call("add", a=12, b=34) if "12+34" in context and turn == 0 else "<answer>1</answer>"

    tools, engine = loop(tok, script)
    out = tools(None, [prompt_ids(tok), prompt_ids(tok, "What is 5+6?")], 2)
    assert len(engine.calls[1]) == 2  # only the two rows that called a tool generate again
    assert out.stats["turns"].tolist() == [2.0, 2.0, 1.0, 1.0]
    assert out.tool_mask[2:].sum().item() == out.completion_mask[2:].sum().item()


def test_one_forward_gives_the_per_turn_log_probs(tok, tiny_tool_dir):
    """The trainer's log-probs come from one forward over the whole multi-turn completion; each turn's tokens
    must get the log-probs a forward over its own context (prompt + earlier turns + tool results) gives."""
    from transformers import AutoModelForCausalLM

    from rlft.core.logprobs import selective_log_softmax

    model = AutoModelForCausalLM.from_pretrained(tiny_tool_dir).eval()

    def script(context, turn):
        return [call("add", a=12, b=34), call("add", a=46, b=1), "<answer>47</answer>"][turn]

    tools, engine = loop(tok, script)
    prompts = [prompt_ids(tok), prompt_ids(tok, "Add 12 and 34 please, then one more.")]
    out = tools(None, prompts, 1)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    width = out.completion_ids.shape[1]
    one_pass = selective_log_softmax(logits[:, -width - 1:-1], out.completion_ids, 1.0, 64)
    for row, prompt in enumerate(prompts):
        n = int(out.completion_mask[row].sum())
        completion, trained = out.completion_ids[row, :n].tolist(), out.tool_mask[row, :n].tolist()
        starts = [i for i in range(n) if trained[i] and (i == 0 or not trained[i - 1])]
        for start in starts:  # each turn, from its own context
            end = next((i for i in range(start, n) if not trained[i]), n)
            context = torch.tensor([prompt + completion[:end]])
            with torch.no_grad():
                turn_logits = model(input_ids=context).logits[0, len(prompt) + start - 1:len(prompt) + end - 1]
            per_turn = torch.log_softmax(turn_logits.float(), -1).gather(1, context[0, len(prompt) + start:][:, None])
            torch.testing.assert_close(one_pass[row, start:end], per_turn[:, 0], atol=2e-5, rtol=0)
        assert len(starts) == 3


def test_each_tokens_weights_version_is_kept_across_turns_and_tool_output_takes_the_one_before_it(tok):
    """In-flight weight updates reach a tool loop between (or inside) turns: each turn's tokens keep the
    versions its engine recorded, the tool's output (not sampled) the version of the token before it."""
    engine = Scripted(tok, add_then_answer)
    versions = iter([5, 7])

    def versioned(model, prompt_ids, num_generations, greedy=False, max_new_tokens=None):
        out = Scripted.__call__(engine, model, prompt_ids, num_generations, greedy, max_new_tokens)
        version = next(versions)
        out.token_versions = torch.full_like(out.completion_ids, version, dtype=torch.int32)
        out.token_versions[:, 1:] += 1  # newer weights loaded after each turn's first token
        out.token_versions = out.token_versions.masked_fill(out.completion_mask == 0, -1)
        return out

    toolset = Toolset({"add": add}, tool_schemas([add]))
    rollout = ToolLoop(versioned, tok, toolset, 96)(None, [prompt_ids(tok)], 1)
    row, mask, policy = rollout.token_versions[0], rollout.completion_mask[0].bool(), rollout.tool_mask[0].bool()
    output = ~policy & mask  # the tool's output: in the completion, not sampled
    sampled = row[policy & mask].tolist()
    turn_one = len(tok(call("add", a=12, b=34), add_special_tokens=False)["input_ids"]) + 1  # + EOS
    assert sampled == [5] + [6] * (turn_one - 1) + [7] + [8] * (len(sampled) - turn_one - 1)
    assert set(row[output].tolist()) == {6} and int(output.nonzero()[0]) == turn_one
    assert (row[~mask] == -1).all()
