"""Downstream evaluation: task files and their errors, the Scorer against a direct computation and lm-eval's own
rolling windows, the same tokens and numbers from one process and from every 2-rank layout (real gloo ranks), the
lm-evaluation-harness model type against hybridpar's evaluator, and the launcher."""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, launcher, run_cli, user_env
from hybridpar.config.cli import load_config
from hybridpar.errors import ConfigError, UserError
from hybridpar.inference.evaluate import Scorer, run_task, vocab_parallel_logprobs
from hybridpar.inference.generate import Sampling, generate
from hybridpar.inference.tasks import read_task
from warm import Results, spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORDS = "the a of to in is that for it as with was on be by this are or from at an which not have but".split()


def write_tasks(d) -> dict:
    """A multiple-choice, a cloze and a perplexity task of byte-tokenizer text (the longest document spans several
    32-token windows), as JSONL files in d."""
    rng = random.Random(0)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    mc = [{"context": sentence(rng.randint(2, 6)), "choices": [" " + sentence(rng.randint(1, 3)) for _ in range(3)],
           "label": rng.randrange(3)} for _ in range(12)]
    cloze = [{"context": sentence(rng.randint(3, 8)), "target": " " + rng.choice(WORDS)} for _ in range(8)]
    text = [{"text": sentence(40)}, {"text": sentence(5)}]
    paths = {}
    for name, rows in (("mc", mc), ("cloze", cloze), ("text", text)):
        paths[name] = d / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def test_task_files_and_their_one_line_errors(tmp_path):
    paths = write_tasks(tmp_path)
    assert [read_task(p).kind for p in paths.values()] == ["multiple_choice", "cloze", "perplexity"]
    (tmp_path / "doc.txt").write_text("one document\n")
    assert read_task(tmp_path / "doc.txt").examples == ({"text": "one document\n"},)
    cases = [("missing.jsonl", None, "does not exist"),
             ("bad.jsonl", '{"context": "a", "target": " b"}\n{"context": \n', "bad.jsonl:2: not a JSON object"),
             ("mixed.jsonl", '{"context": "a", "target": " b"}\n{"text": "t"}\n',
              "mixed.jsonl:2: a perplexity line in a cloze task"),
             ("label.jsonl", '{"context": "a", "choices": [" b", " c"], "label": 2}\n', "label 2 must be an index"),
             ("kind.jsonl", '{"question": "a"}\n', "a task line needs context + choices + label"),
             ("empty.jsonl", "\n\n", "holds no examples"),
             ("list.jsonl", "[1, 2]\n", "list.jsonl:1: not a JSON object"),
             ("many.jsonl", json.dumps({"context": "a", "choices": [" b"] * 100_000, "label": 0}) + "\n",
              "many.jsonl:1: 100,000 choices, over 1,000")]
    for name, text, message in cases:
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_task(tmp_path / name)


def _model_and_scorer(max_len=16, batch_size=3):
    from hybridpar.data.tokenizer import ByteTokenizer
    from hybridpar.models import build_model, get_model_config
    from hybridpar.parallel.distributed import init_mesh

    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=64),
                        device="cpu").eval()
    mesh = init_mesh((1, 1, 1, 1), torch.device("cpu"))
    return model, Scorer(model, mesh, torch.device("cpu"), ByteTokenizer(), max_len, batch_size)


def test_scorer_equals_a_direct_computation_and_lm_evals_rolling_windows():
    """Each request's log-likelihood is the sum of log_softmax(model(whole sequence)) at the continuation's tokens,
    computed here one request at a time without padding; the greedy flag is argmax == target at every one. A
    context longer than the window is cut from the left. Rolling windows score what lm-eval's own
    get_rolling_token_windows + make_disjoint_window would ask for, token for token."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, scorer = _model_and_scorer()
        rng = random.Random(1)
        pairs = [([rng.randrange(1, 256) for _ in range(rng.randint(1, 30))],
                  [rng.randrange(1, 256) for _ in range(rng.randint(1, 8))]) for _ in range(10)]
        model_greedy = model(torch.tensor([[5, 6, 7]]))[0].argmax(-1).tolist()
        pairs.append(([5, 6, 7], model_greedy[2:3]))  # a continuation that is the greedy token
        got = scorer.loglikelihood(pairs)
        with torch.no_grad():
            for (ctx, cont), (ll, greedy) in zip(pairs, got):
                seq = (ctx + cont)[-17:]
                logp = model(torch.tensor([seq[:-1]]))[0].log_softmax(-1)
                rows = logp[-len(cont):]
                want = float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum())
                assert abs(ll - want) < 1e-5 * max(1.0, abs(want)), (ll, want)
                assert greedy == (rows.argmax(-1).tolist() == cont)
        assert got[-1][1] is True

        doc = [rng.randrange(1, 256) for _ in range(50)]  # 50 tokens in windows of 16
        ours = scorer.rolling_pairs(doc)
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(doc, 0, 16, 1)]
        assert [((c + t)[-17:], t) for c, t in ours] == [((c + t)[-17:], t) for c, t in theirs]
        assert sum(len(t) for _, t in ours) == 50
        # A long scoring says how far it is: with the interval below 0, before every forward,
        # with the forwards done of the total (11 requests in batches of 3: 4 forwards), the numbers unchanged.
        import hybridpar.inference.evaluate as evaluate_module

        seen = []
        counting = Scorer(model, scorer.mesh, torch.device("cpu"), scorer.tok, 16, 3, progress=lambda *a: seen.append(a))
        was, evaluate_module.PROGRESS_S = evaluate_module.PROGRESS_S, -1.0
        try:
            assert counting.loglikelihood(pairs) == got
        finally:
            evaluate_module.PROGRESS_S = was
        assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
    finally:
        dist.destroy_process_group()


def test_task_metrics_equal_a_hand_computation(tmp_path):
    """acc (argmax log-likelihood), acc_norm (divided by the choice's characters), cloze acc (all greedy) and ppl
    (exp of minus the mean log-likelihood), and the perplexities of a document from its rolling log-likelihood,
    each recomputed here from the Scorer's per-request numbers (which the test above checks)."""
    paths = write_tasks(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, scorer = _model_and_scorer(max_len=32)
        mc, cloze, text = (read_task(p) for p in paths.values())
        m = run_task(mc, scorer)
        acc = acc_norm = 0
        for e in mc.examples:
            lls = [ll for ll, _ in scorer.loglikelihood([scorer.encode_pair(e["context"], c) for c in e["choices"]])]
            acc += max(range(3), key=lambda i: lls[i]) == e["label"]
            acc_norm += max(range(3), key=lambda i: lls[i] / len(e["choices"][i])) == e["label"]
        assert (m["acc"], m["acc_norm"], m["examples"]) == (acc / 12, acc_norm / 12, 12)
        assert abs(m["chance"] - 1 / 3) < 1e-12
        c = run_task(cloze, scorer)
        res = scorer.loglikelihood([scorer.encode_pair(e["context"], e["target"]) for e in cloze.examples])
        assert c["acc"] == sum(g for _, g in res) / 8
        assert abs(c["ppl"] - math.exp(-sum(v for v, _ in res) / 8)) < 1e-9 * c["ppl"]
        p = run_task(text, scorer)
        docs = [e["text"] for e in text.examples]
        total = sum(v for d in docs for v, _ in scorer.loglikelihood(scorer.rolling_pairs(list(d.encode()))))
        n_bytes, words = sum(len(d.encode()) for d in docs), sum(len(d.split()) for d in docs)
        assert abs(p["bits_per_byte"] - (-total / n_bytes / math.log(2))) < 1e-9
        assert abs(math.log(p["word_perplexity"]) - (-total / words)) < 1e-9
        assert abs(math.log(p["token_perplexity"]) - (-total / n_bytes)) < 1e-9  # bytes are the tokens here
    finally:
        dist.destroy_process_group()



def test_acc_norm_divides_by_characters_and_continuations_are_encoded_in_context(tmp_path):
    """With a BPE tokenizer, where a choice's characters and tokens differ (lm-eval's conventions: encode context +
    continuation, take the tokens after the context's own encoding, feed context + those; acc_norm divides by
    characters), and where merges cross the boundary (the split then differs from encoding the two apart). The
    reference is lm-eval's own _encode_pair and a plain forward of each sequence, summed here over the
    continuation's positions; on this model dividing by tokens picks other answers, so a scorer that did would
    fail."""
    from hybridpar.data.tokenizer import HFTokenizer, train_bpe
    from hybridpar.models import build_model, get_model_config
    from hybridpar.parallel.distributed import init_mesh

    rng = random.Random(1)
    docs = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = HFTokenizer(train_bpe(docs, 400), "bpe:test")
    examples = [{"context": "the wor", "choices": ["d", "d of the which", "k", "ds are"], "label": 1},
                {"context": "for an", "choices": [" have but", " at", "d with", " from the"], "label": 0},
                {"context": "it wa", "choices": ["y of that", " not", "y", " be"], "label": 3},
                # merges across the boundary: "it is th" + "e of" encodes as [it, is, the, of], not [.., th, e, of]
                {"context": "it is th", "choices": ["e of", "at of", "is on", "ere for"], "label": 1}]
    crossing = [(e["context"], c) for e in examples for c in e["choices"]
                if tok.encode(e["context"]) + tok.encode(c) != tok.encode(e["context"] + c)]
    assert len(crossing) >= 3, crossing  # (the test can tell a scorer that encodes the two apart)
    from lm_eval.api.model import TemplateLM

    class _Theirs:  # lm-eval's own split of a pair, on this tokenizer (a causal model's convention)
        backend = "causal"

        def tok_encode(self, text, **_):
            return tok.encode(text)

    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_model(get_model_config("tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=tok.vocab_size,
                                             max_seq_len=64), device="cpu").eval()
        scorer = Scorer(model, init_mesh((1, 1, 1, 1), torch.device("cpu")), torch.device("cpu"), tok, 32, 3)
        got = run_task(read_task(tmp_path / "mc.jsonl"), scorer)
        acc = acc_norm = differs = 0
        for e in examples:
            lls, n_tokens = [], []
            for c in e["choices"]:
                ctx, cont = TemplateLM._encode_pair(_Theirs(), e["context"], c)  # what lm-eval feeds: ctx + cont
                whole = ctx + cont
                with torch.no_grad():
                    logp = model(torch.tensor([whole])).float().log_softmax(-1)[0]  # (T, V)
                lls.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
                n_tokens.append(len(whole) - len(ctx))
            assert [scorer.encode_pair(e["context"], c) for c in e["choices"]] == [
                TemplateLM._encode_pair(_Theirs(), e["context"], c) for c in e["choices"]]
            want = [v for v, _ in scorer.loglikelihood([scorer.encode_pair(e["context"], c) for c in e["choices"]])]
            assert all(abs(a - b) < 1e-5 for a, b in zip(want, lls)), (want, lls)  # request by request
            by_chars = max(range(4), key=lambda i: lls[i] / len(e["choices"][i]))
            acc += max(range(4), key=lambda i: lls[i]) == e["label"]
            acc_norm += by_chars == e["label"]
            differs += by_chars != max(range(4), key=lambda i: lls[i] / n_tokens[i])
        assert (got["acc"], got["acc_norm"]) == (acc / 4, acc_norm / 4)
        assert differs >= 1  # the test can tell characters from tokens
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_logprobs_equal_log_softmax():
    """The hand-written log-softmax (max, sum of exponentials, picked logit) of one rank against torch's."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 4
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 0] = -1
    logprob, greedy = vocab_parallel_logprobs(logits, targets)
    want = logits.log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    want[0, 0] = 0
    torch.testing.assert_close(logprob, want)
    assert greedy.tolist() == ((logits.argmax(-1) == targets) & (targets >= 0)).tolist()


# -- every layout of 2 ranks gives one process's tokens and numbers ---------------------------------------------
LAYOUTS = {"tp": ["--parallel.tp", "2"], "tp+sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
           "fsdp": ["--parallel.dp_shard", "2"], "replicate": ["--parallel.dp_replicate", "2", "--parallel.dp_shard",
                                                               "1"],
           "cp": ["--parallel.cp", "2", "--parallel.dp_shard", "1"]}
PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98], [65]]
# 11 (context, continuation) requests of distinct lengths: 3 batches of 4, which 2 data-parallel ranks do not divide
# (one rank scores a spare batch and throws it away); each request is compared, not only the metrics they make. The
# last three continue with bytes 200-255, ids that live on the last tp rank (tp 2 of the 384-token vocabulary: rows
# 192-383), which ASCII text never reaches.
REQUESTS = [(PROMPTS[1][:1 + i % 9], PROMPTS[1][1 + i % 9:][:1 + i % 3] or [32]) for i in range(8)] + [
    (PROMPTS[0], [200, 230]), ([65, 66], [255]), ([250, 251, 252, 72], [201, 33, 222])]


def _everything(ckpt: str, argv: list[str], tasks: dict) -> dict:
    """Greedy and sampled tokens of PROMPTS and every task's metrics, on this world's layout."""
    from hybridpar.inference.load import load_for_inference

    loaded = load_for_inference(ckpt, load_config(argv), "bytes")
    run = loaded.run
    pad = run.layout.tp if run.cfg.parallel.sequence_parallel else 1
    out = {"degrees": run.layout.degrees}
    for name, s in (("greedy", Sampling(max_new_tokens=16, stop_at_eod=False)),
                    ("sampled", Sampling(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=3))):
        out[name] = generate(loaded.model, PROMPTS, s, run.device, 0, pad_multiple=pad).tokens
    scorer = Scorer(loaded.model, loaded.mesh, run.device, loaded.tokenizer, run.cfg.train.seq_len, 4,
                    pad_multiple=pad)
    for name, path in tasks.items():
        out[name] = {k: v for k, v in run_task(read_task(path), scorer).items() if k != "seconds"}
    out["requests"] = scorer.loglikelihood(REQUESTS)
    return out


def _layout_worker(rank: int, init_file: str, ckpts: dict, tasks: dict, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for family, ckpt in ckpts.items():
            for layout, argv in LAYOUTS.items():
                results[rank, family, layout] = _everything(ckpt, argv, tasks)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_layout_generates_the_same_tokens_and_scores_the_same_numbers(tmp_path):
    """GPT-2 family (learned positions) and modern family (RoPE, GQA, SwiGLU) checkpoints, on 2 gloo ranks as tp 2,
    tp 2 with sequence parallelism, FSDP over 2 and replicated over 2, against one process: the same greedy and
    seeded-sampled tokens, the same accuracies, and log-likelihood metrics equal to 1e-5 (other reduction orders).
    Context parallelism (cp 2) scores two of each window's four chunks on each of its ranks, and generates with the
    whole sequence on each (the KV cache's path)."""
    from test_convert import _checkpoint
    from hybridpar.parallel.distributed import shutdown

    tasks = {k: str(v) for k, v in write_tasks(tmp_path).items()}
    ckpts = {}
    for family in ("gpt2", "llama"):
        (tmp_path / family).mkdir()
        ckpts[family] = str(_checkpoint(tmp_path / family, family, max_seq_len=64)[1])
    reference = {}
    for family, ckpt in ckpts.items():
        try:
            reference[family] = _everything(ckpt, [], tasks)
        finally:
            shutdown()
    results = Results()
    spawn(_layout_worker, args=(str(tmp_path / "init"), ckpts, tasks, results), nprocs=2)
    for family, want in reference.items():
        # not a degenerate repetition (a random model: greedy repeats some tokens, sampling spreads)
        assert len({t for seq in want["greedy"] for t in seq}) >= 5 and len({t for seq in want["sampled"]
                                                                              for t in seq}) > 20
        for layout in LAYOUTS:
            for rank in range(2):
                got = results[rank, family, layout]
                where = (family, layout, rank)
                assert layout != "cp" or got["degrees"] == (1, 1, 2, 1), got["degrees"]  # (each rank half a window)
                assert got["greedy"] == want["greedy"] and got["sampled"] == want["sampled"], where
                assert got["mc"]["acc"] == want["mc"]["acc"] and got["mc"]["acc_norm"] == want["mc"]["acc_norm"], where
                assert got["cloze"]["acc"] == want["cloze"]["acc"], where
                for task, metric in (("cloze", "ppl"), ("text", "bits_per_byte"), ("text", "word_perplexity")):
                    assert abs(got[task][metric] - want[task][metric]) <= 1e-5 * abs(want[task][metric]), where
                assert len(got["requests"]) == len(REQUESTS) == 11, where
                assert sum(t >= 192 for _, cont in REQUESTS for t in cont) == 5
                for (ll, greedy), (want_ll, want_greedy) in zip(got["requests"], want["requests"]):
                    assert greedy == want_greedy and abs(ll - want_ll) <= 1e-5 * abs(want_ll), where


# -- lm-evaluation-harness --------------------------------------------------------------------------------------
HARNESS_TASKS = {
    "mc": "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\n"
          "target_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "cloze": "output_type: loglikelihood\ndoc_to_text: context\ndoc_to_target: target\ntarget_delimiter: ''\n"
             "metric_list:\n  - metric: perplexity\n  - metric: acc\n",
    "text": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: text\nmetric_list:\n"
            "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    "gen": "output_type: generate_until\ndoc_to_text: context\ndoc_to_target: target\ngeneration_kwargs:\n"
           "  until: ['zz']\n  max_gen_toks: 10\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
}


@pytest.mark.multiprocess  # (importing lm-eval runs ldconfig)
def test_harness_indexes_only_the_include_path_when_every_task_is_there(tmp_path):
    """launch/harness.py skips lm-eval's built-in task index only when every task named is a task of --include_path:
    a built-in task, a group of the include path or a file path beside them keeps the full index."""
    import lm_eval.tasks

    harness, full = launcher("harness"), lm_eval.tasks.TaskManager
    (tmp_path / "a.yaml").write_text("task: mine_a\ndataset_path: json\noutput_type: loglikelihood\n")
    (tmp_path / "b.yaml").write_text("task: mine_b\ndataset_path: json\noutput_type: loglikelihood\n")
    (tmp_path / "g.yaml").write_text("group: mine_group\ntask: [mine_a, hellaswag]\n")
    base = ["--model", "hybridpar", "--include_path", str(tmp_path)]
    assert harness._option(base + ["--tasks", "mine_a,mine_b", "x", "--batch_size", "4"], ("--tasks", "-t")) == \
        ["mine_a", "mine_b", "x"]
    assert harness._option(["-t=a,b", "--limit", "3"], ("--tasks", "-t")) == ["a", "b"]
    try:
        for tasks in (["mine_a", "hellaswag"], ["mine_group"], ["mine_a", str(tmp_path / "b.yaml")]):
            harness._index_include_path_only(base + ["--tasks", *tasks])
            assert lm_eval.tasks.TaskManager is full, tasks
        harness._index_include_path_only(["--tasks", "mine_a"])  # no include path
        assert lm_eval.tasks.TaskManager is full
        harness._index_include_path_only(base + ["--tasks", "mine_a", "mine_b"])
        manager = lm_eval.tasks.TaskManager(include_path=str(tmp_path))
        assert isinstance(manager, full) and sorted(manager.all_subtasks) == ["mine_a", "mine_b"]
    finally:
        lm_eval.tasks.TaskManager = full


@pytest.mark.multiprocess  # (importing lm-eval runs ldconfig)
def test_harness_names_a_first_label_past_its_choices(tmp_path):
    """lm-eval builds a task by looking its first document's label up in its choices: label 5 of 2 choices is one
    line naming the task and the label (it was lm-eval's bare IndexError); a good first label builds the task, and
    lm-eval's own class is put back after."""
    from lm_eval.api.task import ConfigurableTask

    harness, build = launcher("harness"), ConfigurableTask.__init__
    good = '{"context": "x", "choices": [" y", " z"], "label": 1}\n'
    for name, lines, want in [("bad", '{"context": "a", "choices": [" c", " d"], "label": 5}\n' + good,
                               "task local_bad: its first document's target is 5, past its 2 choices; give a label "
                               "from 0 to 1"),
                              ("good", good + '{"context": "a", "choices": [" c", " d"], "label": 0}\n', None)]:
        (tmp_path / f"{name}.jsonl").write_text(lines)
        config = {"task": f"local_{name}", "dataset_path": "json", "test_split": "test", "target_delimiter": "",
                  "dataset_kwargs": {"data_files": {"test": str(tmp_path / f"{name}.jsonl")}},
                  "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
                  "doc_to_target": "label", "metric_list": [{"metric": "acc"}]}
        with harness._labels_named():
            if want is None:
                task = ConfigurableTask(config=config)
                assert [task.doc_to_target(d) for d in task.eval_docs] == [1, 0]
            else:
                with pytest.raises(UserError, match=re.escape(want) + "$"):
                    ConfigurableTask(config=config)
        assert ConfigurableTask.__init__ is build
    with pytest.raises(IndexError):  # what lm-eval itself does with it
        ConfigurableTask(config={**config, "task": "plain", "dataset_kwargs": {"data_files": {
            "test": str(tmp_path / "bad.jsonl")}}})


@pytest.mark.multiprocess
def test_lm_eval_harness_on_local_tasks_equals_hybridpars_evaluator(tmp_path):
    """`launch/harness.py --model hybridpar` (lm-eval's own command line, tasks defined from local JSONL files,
    offline) against launch/evaluate.py on the same files and checkpoint: equal accuracies, and log-likelihood
    metrics equal to 1e-6 (the harness orders the requests its own way, so batches differ); its generate_until
    texts (logged samples) equal hybridpar's greedy generation cut at the stop string."""
    from test_convert import _checkpoint

    paths = write_tasks(tmp_path)
    _, ckpt = _checkpoint(tmp_path, "llama", max_seq_len=64)
    include = tmp_path / "harness_tasks"
    include.mkdir()
    for name, body in HARNESS_TASKS.items():
        data = paths["cloze" if name == "gen" else name]
        (include / f"{name}.yaml").write_text(f"task: local_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                              f"    test: {data}\ntest_split: test\n{body}")

    def harness_run(name, model_args="", nproc=1):
        cmd = ["launch/harness.py", "--model", "hybridpar", "--model_args", f"checkpoint={ckpt},tokenizer=bytes"
               + model_args, "--include_path", str(include), "--tasks", "local_mc,local_cloze,local_text,local_gen",
               "--batch_size", "4", "--output_path", str(tmp_path / name), "--log_samples"]
        if nproc > 1:
            cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
        out = run_cli(cmd)  # (offline, with a cache of its own: conftest sets HF_* for the session)
        assert out.returncode == 0, out.stderr[-3000:]
        [result_file] = list((tmp_path / name).rglob("results_*.json"))  # one: rank 0's
        [samples] = list((tmp_path / name).rglob("samples_local_gen_*.jsonl"))
        assert out.stdout.count("|local_mc") == 1, out.stdout  # one results table
        return json.loads(result_file.read_text())["results"], samples

    harness, samples = harness_run("harness_out")
    ours_out = run_cli(["launch/evaluate.py", str(ckpt), "--tokenizer", "bytes", "--batch-size", "4", "--tasks",
                        *map(str, paths.values()), "--json", str(tmp_path / "ours.json")])
    assert ours_out.returncode == 0, ours_out.stderr
    ours = json.loads((tmp_path / "ours.json").read_text())["tasks"]
    close = lambda a, b: abs(a - b) <= 1e-6 * max(1.0, abs(b))
    assert harness["local_mc"]["acc,none"] == ours["mc"]["acc"]
    assert harness["local_mc"]["acc_norm,none"] == ours["mc"]["acc_norm"]
    assert harness["local_cloze"]["acc,none"] == ours["cloze"]["acc"]
    assert close(harness["local_cloze"]["perplexity,none"], ours["cloze"]["ppl"])
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert close(harness["local_text"][f"{metric},none"], ours["text"][metric]), metric

    # Under torchrun (tp 2, and FSDP over 2 x tp 2) every rank must score the same requests (lm-eval splits them by
    # the rank the model reports): the same numbers, texts generated alike, one results file and table
    for name, model_args, nproc in (("tp2", ",tp=2", 2), ("fsdp2_tp2", ",dp_shard=2,tp=2", 4)):
        got, got_samples = harness_run(name, model_args, nproc)
        for task, metrics in harness.items():
            for metric, want in metrics.items():
                if isinstance(want, float) and not metric.endswith("_stderr,none"):
                    assert close(got[task][metric], want), (name, task, metric)
        gen = lambda path: [json.loads(line)["resps"] for line in path.read_text().splitlines()]
        assert gen(got_samples) == gen(samples), name

    from hybridpar.data.tokenizer import ByteTokenizer
    from hybridpar.inference.load import load_for_inference
    from hybridpar.parallel.distributed import shutdown

    texts = {json.loads(line)["doc"]["context"]: json.loads(line)["resps"][0][0]
             for line in samples.read_text().splitlines()}
    contexts = [json.loads(line)["context"] for line in paths["cloze"].read_text().splitlines()]
    try:
        loaded = load_for_inference(str(ckpt), load_config([]), "bytes")
        for context in contexts:
            ids = ByteTokenizer().encode(context)[-(32 - 10):]  # the window (train.seq_len 32) less 10 new tokens
            new = generate(loaded.model, [ids], Sampling(max_new_tokens=10),
                           torch.device("cpu"), 0, vocab_limit=256).tokens[0]
            assert texts[context] == ByteTokenizer().decode(new).split("zz")[0], context
    finally:
        loaded = None
        shutdown()


@pytest.mark.multiprocess
def test_evaluate_launcher_refuses_bad_input_with_one_line(tmp_path, cache_dir, capsys):
    """Bad task files, options and layouts through launch/evaluate.py's cli() in this process; a to-torch export
    loads to the DCP checkpoint's own numbers and tokens, and once truncated is one line through both launchers; a
    bad task file given to a training run stops it before it writes anything. One line each, exit status 2."""
    from conftest import launcher
    from hybridpar.inference.load import load_for_inference
    from hybridpar.parallel.distributed import shutdown
    from test_convert import _checkpoint

    convert, evaluate, generate_cli = (launcher(n).cli for n in ("convert_checkpoint", "evaluate", "generate"))
    paths = write_tasks(tmp_path)
    _, ckpt = _checkpoint(tmp_path, "gpt2", max_seq_len=64)
    (tmp_path / "broken.jsonl").write_text('{"context": "a", "choices": [" b"], "label": 0}\n')
    base = [str(ckpt), "--tokenizer", "bytes"]
    capsys.readouterr()
    for argv, message in [(base + ["--tasks", str(tmp_path / "nope.jsonl")], "does not exist"),
                          (base + ["--tasks", str(tmp_path / "broken.jsonl")], "broken.jsonl:1: context must be text and "
                                                                               "choices a list of two or more"),
                          (base, "give --tasks"),
                          (base + ["--tasks", str(paths["mc"]), "--max-len", "100"], "exceeds the model's context"),
                          (base + ["--tasks", str(paths["mc"]), "--parallel.tp", "2"], "world"),
                          (base + ["--tasks", str(paths["mc"]), "--json", str(tmp_path / "no" / "r.json")],
                           "is in no existing directory"),
                          (base + ["--tasks", str(paths["mc"]), "--json", str(tmp_path)], "is a directory")]:
        assert evaluate(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    # a full disk (a real 16 KiB tmpfs, in a mount namespace of its own): the whole evaluation runs, then one line,
    # and neither the file nor a temporary one is left there
    full = tmp_path / "full"
    full.mkdir()
    script = (f"mount -t tmpfs -o size=16k tmpfs {full} && head -c 16384 /dev/zero > {full}/filler; "
              f"{sys.executable} launch/evaluate.py {' '.join(base)} --tasks {paths['mc']} --json {full}/r.json; "
              f"echo rc=$?; ls -A {full}")
    out = run_cli(["-c", f"import subprocess, sys; sys.exit(subprocess.call(['unshare', '--mount', "
                         f"'--propagation', 'private', 'sh', '-c', {script!r}]))"])
    assert "rc=2" in out.stdout and out.stdout.strip().endswith("rc=2\nfiller"), (out.stdout, out.stderr)
    assert "could not be written (No space left on device); nothing was written there" in out.stderr, out.stderr
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr

    export = tmp_path / "export"
    assert convert(["to-torch", "--checkpoint", str(ckpt), "--out", str(export)]) == 0
    got = []
    for source in (ckpt, export):
        try:
            loaded = load_for_inference(str(source), load_config([]), "bytes")
            scorer = Scorer(loaded.model, loaded.mesh, loaded.run.device, loaded.tokenizer, 32)
            tokens = generate(loaded.model, PROMPTS, Sampling(max_new_tokens=8), loaded.run.device, 0).tokens
            got.append((tokens, run_task(read_task(paths["mc"]), scorer), run_task(read_task(paths["text"]), scorer)))
        finally:
            loaded = scorer = None
            shutdown()
    (tokens_a, mc_a, text_a), (tokens_b, mc_b, text_b) = got
    assert tokens_a == tokens_b and mc_a["acc"] == mc_b["acc"] and mc_a["acc_norm"] == mc_b["acc_norm"]
    assert abs(text_a["bits_per_byte"] - text_b["bits_per_byte"]) < 1e-6
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    for cli, argv in ((evaluate, [str(export), "--tokenizer", "bytes", "--tasks", str(paths["mc"])]),
                      (generate_cli, [str(export), "x", "--tokenizer", "bytes"])):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert "is not a readable safetensors file" in err and len(err.strip().splitlines()) == 1, err

    run_dir = tmp_path / "run"
    out = run_cli(["launch/pretrain_gpt.py", "--train.steps", "2", "--data.cache_dir", str(cache_dir), "--run.dir",
                   str(run_dir), "--train.eval_tasks", str(tmp_path / "nope.jsonl")])
    assert out.returncode == 2 and "nope.jsonl' does not exist" in out.stderr and not run_dir.exists(), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # Under torchrun every rank meets a bad task file: it is said once.
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/evaluate.py", *base,
                   "--tasks", str(tmp_path / "broken.jsonl")])
    assert out.returncode != 0 and out.stderr.count("broken.jsonl:1: context must be text") == 1, out.stderr[-3000:]
    # Ctrl-C while scoring (a task of 3,000 examples): a line, exit 130, no traceback and no --json file.
    import signal
    import subprocess

    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"context": f"w{i} and", "choices": [" a", " b c"], "label": i % 2}) + "\n"
                           for i in range(3000)))
    proc = subprocess.Popen([sys.executable, "launch/evaluate.py", *base, "--tasks", str(big), "--json",
                             str(tmp_path / "r.json")], cwd=ROOT, env=user_env(), stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    assert first.startswith("big: scoring 3,000 examples"), first
    proc.send_signal(signal.SIGINT)
    err = first + proc.stderr.read()
    assert proc.wait(timeout=120) == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted: evaluation stopped (--json not written)", err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.multiprocess  # importing lm-eval starts a process (huggingface_hub)
def test_harness_refuses_bad_model_args_and_pickled_caches_in_one_line(tmp_path, monkeypatch, capsys):
    """launch/harness.py in this process: a model_args typo, a missing checkpoint, a batch size or window that is
    no positive number, and lm-eval's pickled caches (--use_cache, --cache_requests): one line each, exit 2,
    nothing written; the options that write results are dropped on ranks other than 0."""
    harness = launcher("harness")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text(f"task: local_t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                               f"    test: {tmp_path / 'none.jsonl'}\ntest_split: test\n"
                                               + HARNESS_TASKS["mc"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["harness.py", "--model", "hybridpar", "--include_path", str(tmp_path / "tasks"), "--tasks", "local_t",
            "--output_path", str(tmp_path / "out")]
    cases = [(["--model_args", "checkpoint=runs/x,max_lenght=5"], "max_lenght=... is not an argument of the hybridpar"),
             (["--model_args", "checkpoint=runs/x", "--use_cache", str(tmp_path / "c")], "--use_cache: lm-eval keeps"),
             (["--model_args", "checkpoint=runs/x", "--cache_requests", "true"], "--cache_requests: lm-eval keeps")]
    for extra, message in cases:
        monkeypatch.setattr(sys, "argv", base + extra)
        assert harness.main() == 2
        err = capsys.readouterr().err  # (lm-eval's own INFO log lines come before it)
        last = err.splitlines()[-1]
        assert message in last and last.startswith("error: ") and err.count("error") == 1, (extra, err)
        assert "Traceback" not in err
        assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()
    from hybridpar.interop.lm_eval import HybridparLM

    for args, extra, message in [("chekpoint=runs/x", {}, "chekpoint=... is not an argument of the hybridpar model"),
                                 ("tp=2", {}, "--model_args needs checkpoint=PATH"),
                                 ("checkpoint=runs/x", {"batch_size": "abc"}, "--batch_size='abc' must be a positive"),
                                 ("checkpoint=runs/x,max_length=-5", {}, "max_length=-5"),
                                 ("checkpoint=runs/x,max_length=2.5", {}, "max_length=2.5 must be a positive whole")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            HybridparLM.create_from_arg_string(args, extra)  # as lm-eval makes the model from --model_args
    argv = ["--tasks", "t", "--output_path", "o", "-s", "--wandb_args=project=p", "--log_samples", "--limit", "3"]
    assert harness._for_rank(argv, 0) == argv and harness._for_rank(argv, 1) == ["--tasks", "t", "--limit", "3"]
