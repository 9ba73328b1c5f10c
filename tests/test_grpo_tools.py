"""grpo_tools.py: the tool loop and its batch. By hand: the collated batch of a scripted exchange
(ids, the mask zero exactly on the tool's tokens, the engine's log-probs on the generated ones), and
a tool output that BPE would merge with its neighbour keeps its own ids; a flag of grpo_family.py is
refused with that file's name. With the real engine on the
tiny model: every turn is fed exactly the ids before it; hostile calls are answered and the run goes
on; a run with tool calls keeps train/engine_logprob_gap at float32 rounding; a resumed run replays
the rollouts.

The tiny model is random: it never writes a call by itself. The engine tests force calls with a
test protocol whose stop string is a letter the random model writes within a few tokens ("s"),
and whose program ignores the call and prints a fixed text (FORCED): the ids, masks, log-probs and
seeds are what is tested, not the model's skill."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from conftest import interrupted_at_call

import data
import grpo_tools
import verifiers
from grpo_tools import Args, Rollout

# the stop string is a frequent letter; the output is text the tiny tokenizer knows
FORCED = {
    "open": "",
    "stop": "s",
    "program": "print(' apples 42')",
    "output": "{}",
    "instruction": "Calculator: <<16 + 7>>23",
}


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- the batch, by hand ---


def test_collate_tool_rollouts_by_hand():
    # prompt [5, 6]; generated [7, 8], the tool wrote [9, 10], generated [11]
    rollout = Rollout(
        token_ids=[7, 8, 9, 10, 11],
        is_tool=[False, False, True, True, False],
        logprobs=[-0.1, -0.2, -0.3],
    )
    # a response with no call, one token shorter in all
    plain = Rollout(token_ids=[12, 13, 14], is_tool=[False] * 3, logprobs=[-0.4, -0.5, -0.6])
    batch, lengths = grpo_tools.collate_tool_rollouts(
        [[5, 6], [5]],
        [rollout, plain],
        torch.tensor([1.0, -1.0]),
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [5, 12, 13, 14, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0]]
    # 0 on the prompt, on the tool's tokens 9 and 10, and on the padding
    assert batch["response_mask"].int().tolist() == [[0, 1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    # the engine's log-probs sit on the labels they were sampled as, and nowhere else
    expected = torch.tensor([[0, -0.1, -0.2, 0, 0, -0.3], [-0.4, -0.5, -0.6, 0, 0, 0]])
    assert torch.equal(batch["engine_log_probs"], expected)
    assert batch["advantages"].tolist() == [[1.0], [-1.0]]
    assert lengths == [6, 3]


def test_a_tool_output_that_bpe_would_merge_keeps_its_own_ids(tiny_model_dir):
    tokenizer = grpo_tools.AutoTokenizer.from_pretrained(tiny_model_dir)
    # the model wrote " app"; the tool answered "les": " apples" is one token of its own
    generated = encode(tokenizer, " app")
    tool = grpo_tools.tool_message_ids("les", FORCED, tokenizer, 8)
    joined = encode(tokenizer, " apples")
    assert len(generated) == len(tool) == len(joined) == 1
    assert joined != generated + tool
    prompt = encode(tokenizer, "Tom has 4")
    rollout = Rollout(token_ids=generated + tool, is_tool=[False, True], logprobs=[-1.0])
    batch, _ = grpo_tools.collate_tool_rollouts([prompt], [rollout], torch.zeros(1))
    # the trainer scores the engine's ids, not those of the decoded text tokenized again
    assert batch["labels"][0].tolist() == prompt[1:] + generated + tool
    assert (
        encode(tokenizer, tokenizer.decode(prompt + generated + tool)) != prompt + generated + tool
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--loss-type", "gspo"],
        ["--loss-type=cispo"],
        ["--dynamic-sampling"],
        ["--no-normalize-by-std"],
    ],
)
def test_a_flag_of_grpo_family_is_refused_with_the_file_that_has_it(flags):
    with pytest.raises(SystemExit, match="grpo_family.py") as refusal:
        grpo_tools.refuse_family_flags(["--max-tool-calls", "2", *flags])
    assert "grpo_tools.py" in str(refusal.value)
    # the flags grpo_tools.py has pass
    grpo_tools.refuse_family_flags(["--max-tool-calls", "2", "--beta", "0.1"])


def test_tool_output_is_cut_to_its_token_budget(tiny_model_dir):
    tokenizer = grpo_tools.AutoTokenizer.from_pretrained(tiny_model_dir)
    python = data.TOOL_PROTOCOLS["python"]
    ids = grpo_tools.tool_message_ids("1234567", python, tokenizer, 3)
    # digits are single tokens: the first 3, inside the output block
    assert tokenizer.decode(ids) == "```output\n123\n```\n"


# --- the protocol (data.py) ---


def test_tool_protocols_read_the_call_and_only_with_tools_say_so():
    calculator = data.TOOL_PROTOCOLS["calculator"]
    turn = "4 - 3 = 1. 1 + 9 = <<1 + 9>>"
    assert data.tool_program(turn, calculator) == "print(1 + 9)"
    python = data.TOOL_PROTOCOLS["python"]
    turn = "Half of 48:\n```python\nprint(48 / 2)\n```\n"
    assert data.tool_program(turn, python) == "print(48 / 2)"
    # a turn that stopped at the fence without opening a block: nothing to run
    assert data.tool_program("text\n```\n", python) is None

    example = dict(data.load("synthetic", "val")[0], dataset="synthetic")
    plain = data.render_prompt(example, "question")
    with_tools = data.render_prompt(example, "question", tools=True)
    assert plain == example["prompt"]
    assert with_tools == example["prompt"] + "\n" + calculator["instruction"]
    assert data.tool_protocol({"verifier": "gsm8k"}, "chat") is python
    assert data.tool_protocol({"verifier": "code"}, "chat") is None


def test_calculator_teacher_calls_on_its_share_of_additions():
    rng = data.random.Random(0)
    examples = data.load("synthetic", "train")[:200]
    for ex in examples[:20]:
        # never calls, never forgets: the gold solution
        assert data.calculator_teacher(ex, 0.0, 0.0, rng)["solution"] == ex["solution"]
        # always calls: every addition through the calculator, whose sums are right
        traced = data.calculator_teacher(ex, 1.0, 1.0, rng)
        assert traced["answer"] == ex["answer"]
        n_additions = ex["solution"].count(" + ")
        assert len(traced["tool_spans"]) == n_additions
        assert traced["solution"].replace(">>", "").count("<<") == n_additions
    n_calls = 0
    n_additions = 0
    for ex in examples:
        traced = data.calculator_teacher(ex, 0.7, 0.3, rng)
        n_calls += len(traced["tool_spans"])
        n_additions += ex["solution"].count(" + ")
        # each span is a tool's output: the sum right after its call
        for start, end in traced["tool_spans"]:
            assert traced["solution"][start - 2 : start] == ">>"
            call = traced["solution"][: start - 2].rsplit("<<", 1)[1]
            assert int(traced["solution"][start:end]) == sum(map(int, call.split(" + ")))
    assert 0.2 < n_calls / n_additions < 0.4


# --- hostile calls, in the sandbox ---

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "write outside": "open({outside!r}, 'w').write('pwned')",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nraise SystemExit(1)",
    "huge output": "import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * (1 << 20))",
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """One engine for the tests that talk to it directly; they come before the runs, which tear
    down vLLM's process-wide state when their engines go."""
    return grpo_tools.init_vllm(str(tiny_model_dir), "cpu", 0, 0.3, 512)


def hostile_programs(tmp_path, port):
    outside = str(tmp_path / "written.txt")
    return {name: p.format(outside=outside, port=port) for name, p in HOSTILE.items()}


def test_hostile_calls_are_answered_and_the_loop_goes_on(llm, tiny_model_dir, tmp_path):
    if not verifiers.bwrap_usable(verifiers.BWRAP) and os.getuid() != 0:
        pytest.skip("the sandbox isolates only with bwrap or a root start (tests/test_code.py)")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    programs = hostile_programs(tmp_path, listener.getsockname()[1])
    tokenizer = grpo_tools.AutoTokenizer.from_pretrained(tiny_model_dir)
    protocols = [dict(FORCED, program=p) for p in programs.values()]
    n = len(protocols)
    prompts = [encode(tokenizer, "Tom has 4 apples.")] * n
    args = Args(max_tool_calls=1, max_tool_output_tokens=16, tool_timeout_s=2.0)
    sampling = dict(temperature=1.0, max_tokens=64, include_stop_str_in_output=True, logprobs=0)

    rollouts = grpo_tools.generate_with_tools(
        llm, prompts, protocols, [None] * n, list(range(n)), sampling, tokenizer, args
    )

    answered = {}
    for name, rollout in zip(programs, rollouts, strict=True):
        assert rollout.n_calls == 1, name
        (tool_turn,) = [t for t in rollout.turns if "tool" in t]
        answered[name] = (tool_turn["status"], tool_turn["tool"])
        # and the response went on after the answer, as long as the budget allowed
        assert "generated" in rollout.turns[-1] or rollout.finish_reason == "length"
    assert answered["fork bomb"][0] == "timeout"
    assert answered["write outside"] == ("error", answered["write outside"][1])
    assert "Error" in answered["write outside"][1]
    assert answered["network"][0] == "error"
    assert answered["kill the parent"][0] == "error"
    # stopped at the sandbox's file limit, and what came back cut to 16 tokens
    assert sum(rollouts[-1].is_tool) <= 16
    # unharmed: nothing written, nobody connected, and we are here to check
    assert not (tmp_path / "written.txt").exists()
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert verifiers.run_tool_calls(["print(6 * 7)"])[0] == {"output": "42", "status": "ok"}


# --- the loop on the real engine: token ids in, token ids out ---


def test_every_turn_is_fed_exactly_the_ids_before_it(llm, tiny_model_dir, monkeypatch):
    tokenizer = grpo_tools.AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = []
    real_generate = llm.generate

    def recorded(prompts, params, use_tqdm):
        outputs = real_generate(prompts, params, use_tqdm=use_tqdm)
        for prompt, output in zip(prompts, outputs, strict=True):
            requests.append((prompt["prompt_token_ids"], list(output.outputs[0].token_ids)))
        return outputs

    monkeypatch.setattr(llm, "generate", recorded)
    prompts = [encode(tokenizer, f"Tom has {k} apples.") for k in range(4)]
    args = Args(max_tool_calls=2, max_tool_output_tokens=8)
    sampling = dict(temperature=1.0, max_tokens=48, include_stop_str_in_output=True, logprobs=0)
    rollouts = grpo_tools.generate_with_tools(
        llm, prompts, [FORCED] * 4, [None] * 4, [1, 2, 3, 4], sampling, tokenizer, args
    )
    tool_ids = grpo_tools.tool_message_ids(" apples 42", FORCED, tokenizer, 8)
    n_calls = 0
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        # rebuild the rollout from the engine's own outputs and the tool's ids, turn by turn
        fed = list(prompt)
        expected = []
        for turn in rollout.turns:
            if "tool" in turn:
                expected += tool_ids
                fed += tool_ids
                continue
            (generated,) = [out for ids, out in requests if ids == fed]
            expected += generated
            fed += generated
        assert rollout.token_ids == expected
        assert len(rollout.logprobs) == rollout.is_tool.count(False)
        assert len(rollout.token_ids) <= 48
        n_calls += rollout.n_calls
    # the forced protocol did call, and at most twice a response
    assert n_calls > 0 and all(r.n_calls <= 2 for r in rollouts)


# --- runs of grpo_tools.main on the tiny model ---


def letter_reward(response, example):
    """Test-only reward: the share of letters in the response."""
    reward = sum(c.isalpha() for c in response) / max(len(response), 1)
    return {"reward": reward, "format_reward": 0.0, "answer_reward": reward}


def tiny_args(tiny_model_dir, tmp_path, **overrides):
    args = dict(
        model=str(tiny_model_dir),
        dataset="synthetic",
        template="question",
        output_dir=str(tmp_path),
        n_grpo_steps=2,
        rollout_batch_size=8,
        group_size=4,
        train_batch_size=8,
        microbatch_size=8,
        max_tokens=24,
        max_tool_calls=2,
        max_tool_output_tokens=8,
        lr=1e-2,
        eval_every=1000,
        n_eval=2,
        eval_max_tokens=16,
        n_log_generations=1,
    )
    return Args(**{**args, **overrides})


@pytest.fixture
def forced_calls(monkeypatch):
    """The synthetic task's calculator replaced by FORCED, the reward by letter_reward, and the
    train split cut to 256 problems (main tokenizes every train prompt once)."""
    monkeypatch.setitem(data.TOOL_PROTOCOLS, "calculator", FORCED)
    monkeypatch.setattr(verifiers, "score", letter_reward)
    load = data.load
    monkeypatch.setattr(
        data, "load", lambda name, split, data_dir=None: load(name, split, data_dir)[:256]
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.usefixtures("forced_calls")
def test_a_run_with_tool_calls_keeps_the_engine_and_trainer_log_probs_equal(
    tiny_model_dir, tmp_path
):
    run_dir = grpo_tools.main(tiny_args(tiny_model_dir, tmp_path))

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/tool_calls_per_response"] > 0.5
        assert m["rollout/tool_tokens_per_generated_token"] > 0
        assert m["train/n_updates"] == 1
        # The engine's log-probs of its sampled tokens, after tool tokens in the context, are the
        # trainer's (float32, T = 1). A re-tokenized sequence or a mask one token off fails this:
        # it compares log-probs of different tokens (~1 apart).
        assert m["train/engine_logprob_gap"] < 1e-5
    assert "eval/tool_calls_per_response" in metrics[0]
    assert "eval/accuracy_with_call" in steps[-1]
    # generations.jsonl shows each turn (the greedy random model writes no "s" here: one turn)
    sample = read_jsonl(run_dir / "generations.jsonl")[0]
    assert "".join(t.get("generated", t.get("tool")) for t in sample["turns"]) == sample["response"]


@pytest.mark.usefixtures("forced_calls")
def test_resume_after_a_kill_replays_the_same_rollouts(tiny_model_dir, tmp_path):
    kwargs = dict(n_grpo_steps=2, save_every=1)
    full = grpo_tools.main(tiny_args(tiny_model_dir, tmp_path / "full", **kwargs))
    # killed during step 2, after its rollouts were written: it restarts after step 1
    with interrupted_at_call(grpo_tools, "reload_and_check", 3):
        grpo_tools.main(tiny_args(tiny_model_dir, tmp_path / "stopped", **kwargs))
    (stopped,) = (tmp_path / "stopped").iterdir()
    assert len(read_jsonl(stopped / "rollouts.jsonl")) == 2 * 2
    resumed = grpo_tools.main(
        tiny_args(tiny_model_dir, tmp_path / "stopped", resume=str(stopped), **kwargs)
    )
    replayed = read_jsonl(resumed / "rollouts.jsonl")
    assert replayed == read_jsonl(full / "rollouts.jsonl")
    # the replayed rollouts did call the tool (the forced protocol's output is in them)
    assert any(" apples 42" in r for group in replayed for r in group["responses"])


# --- eval.py --tools: the same loop, each turn in samples.jsonl ---


def test_the_tool_loop_is_the_same_in_grpo_tools_and_eval():
    # each file's banner names the other ("holds the same copy"); the code under it is one text
    banners = {
        "grpo_tools.py": "# --- ALGORITHM: the tool loop (eval.py holds the same copy) ---\n",
        "eval.py": "# --- ALGORITHM: the tool loop (grpo_tools.py holds the same copy) ---\n",
    }
    texts = []
    for script, banner in banners.items():
        source = (Path(__file__).parents[1] / script).read_text()
        start = source.index(banner) + len(banner)
        texts.append(source[start : source.index("\n# --- ", start)])
    assert "def generate_with_tools(" in texts[0]
    assert texts[0] == texts[1]


def test_eval_with_tools_shows_each_turn(tiny_model_dir, tmp_path, monkeypatch):
    import eval as evaluation

    monkeypatch.setitem(data.TOOL_PROTOCOLS, "calculator", FORCED)
    args = evaluation.Args(
        model=str(tiny_model_dir),
        dataset="synthetic",
        split="val",
        template="question",
        limit=4,
        n=2,
        k=(1, 2),
        temperature=1.0,
        max_tokens=24,
        tools=True,
        max_tool_calls=2,
        max_tool_output_tokens=8,
        out_dir=str(tmp_path),
    )
    run_dir = evaluation.main(args)
    records = read_jsonl(run_dir / "samples.jsonl")
    assert len(records) == 4
    for record in records:
        assert "Calculator:" in record["prompt"]
        for response, turns, n_calls in zip(
            record["responses"], record["turns"], record["n_tool_calls"], strict=True
        ):
            assert "".join(t.get("generated", t.get("tool")) for t in turns) == response
            assert n_calls == sum("tool" in t for t in turns) <= 2
    metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
    calls = [n for record in records for n in record["n_tool_calls"]]
    assert metrics["eval/tool_calls_per_response"] == pytest.approx(sum(calls) / 8)
    assert sum(calls) > 0
    # without a call the prompt offers no tool
    with pytest.raises(ValueError, match="--tools needs"):
        evaluation.validate(evaluation.replace(args, template="gsm8k_kshot"))
