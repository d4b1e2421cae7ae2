"""scripts/regenerate.py: the hf engine on a tiny saved target, and the openai engine against a real
OpenAI-compatible HTTP server on 127.0.0.1 serving the same target."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from support.targets import make_tiny_target
from support.reference import hf_greedy
from fixtures.chat_tokenizers import make_chat_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.entry_point import run as cli_run
from draftsmith.data.regenerate import Conversation
from draftsmith.scripts.regenerate import main
from support.house import REPO as ROOT

SERVER_MAX_TOKENS = 200  # the server refuses longer prompts with HTTP 400, as vLLM does


def sharegpt(*pairs, id):
    return {"id": id, "conversations": [{"from": f, "value": v} for f, v in pairs]}


ROWS = [
    sharegpt(("human", "What is the capital of France?"), ("gpt", "Paris."), id="a_0"),
    sharegpt(("system", "You are terse."), ("human", "Hello"), ("gpt", "Hi."), ("human", "Thanks!"),
             ("gpt", "Welcome."), ("human", "a trailing question nobody answered"), id="b_0"),
    {"text": "def add(a, b): return a + b"},  # 2: plain text: continued (hf), refused by a chat server
    sharegpt(("gpt", "dropped"), ("human", "Rome is the capital of Italy?"), ("gpt", "Yes."), id="c_0"),
    sharegpt(("human", "Say hello. " * 60), ("gpt", "Hello."), id="d_0"),  # 4: too long for the server
    sharegpt(("human", "Answer in one line, please."), ("gpt", "OK."), id="e_0"),
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen") / "target"
    tokenizer = make_chat_tokenizer("chatml")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_target("llama", vocab_size=len(tokenizer), eos_token_id=im_end, pad_token_id=0,
                             max_position_embeddings=1024, initializer_range=0.5)
    model.generation_config.eos_token_id = im_end
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("regen-data") / "rows.json"
    path.write_text(json.dumps(ROWS))
    return path


def reference_answers(target_dir, messages_so_far, max_new_tokens):
    """What the target says, unbatched, to one history."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = tok(tok.apply_chat_template(messages_so_far, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = hf_greedy(model, ids, max_new_tokens)[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    return tok.decode(out[: out.index(eos)] if eos in out else out, skip_special_tokens=True)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*args):
    return main([*map(str, args), "--no-progress"])


def test_hf_engine_regenerates_every_assistant_turn(target_dir, data_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert run("--target", target_dir, "--data", data_file, "--out", out, "--max-new-tokens", 12,
               "--batch-size", 3, "--max-length", 256) == 0
    rows = {r["source_index"]: r for r in read(out)}
    assert sorted(rows) == [0, 1, 2, 3, 5]  # row 4 is skipped and counted
    report = capsys.readouterr().out
    assert "rows written 5" in report and "not_a_conversation" not in report
    assert "skipped prompt_too_long: 1" in report  # row 4's prompt alone passes --max-length

    conv = rows[1]["messages"]  # system and user turns kept, the trailing user turn dropped
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert [conv[i]["content"] for i in (0, 1, 3)] == ["You are terse.", "Hello", "Thanks!"]
    # each answer is the target's own greedy answer given the *regenerated* history (batched = unbatched)
    assert conv[2]["content"] == reference_answers(target_dir, conv[:2], 12)
    assert conv[4]["content"] == reference_answers(target_dir, conv[:4], 12)
    assert conv[2]["content"] != "Hi."
    assert rows[3]["messages"][0] == {"role": "user", "content": "Rome is the capital of Italy?"}
    assert rows[1]["id"] == "b_0" and rows[1]["provenance"] == {
        "target": str(target_dir), "engine": "hf", "max_new_tokens": 12, "temperature": 0.0, "max_length": 256,
        "seed": 0, "prompt_tokens": 32, "source_index": 1}

    with pytest.raises(FileExistsError, match="--resume"):
        run("--target", target_dir, "--data", data_file, "--out", out, "--max-new-tokens", 12)


def test_hf_engine_resume_skips_written_rows_and_repairs_a_cut_line(target_dir, data_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    args = ("--target", target_dir, "--data", data_file, "--out", out, "--max-new-tokens", 6)
    run(*args, "--limit", 2)
    first = read(out)
    with open(out, "ab") as f:
        f.write(b'{"id": "c_0", "source_ind')  # a crash in the middle of a write
    run(*args, "--resume")
    rows = read(out)
    assert rows[:2] == first and sorted(r["source_index"] for r in rows) == [0, 1, 2, 3, 4, 5]
    report = capsys.readouterr().out
    assert "already there 2" in report and "removed a cut last line (25 bytes)" in report  # and says so
    with pytest.raises(ValueError, match="generated with .*max_new_tokens': 6.*use another --out"):
        run("--target", target_dir, "--data", data_file, "--out", out, "--max-new-tokens", 7, "--resume")


def reference_continuation(target_dir, text, prompt_tokens, max_new_tokens):
    """The target's own greedy continuation of the first ``prompt_tokens`` tokens of ``text``, unbatched."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
    out = hf_greedy(model, torch.tensor([ids]), max_new_tokens)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    return tok.decode(ids + (out[: out.index(eos)] if eos in out else out), skip_special_tokens=True)


def test_hf_engine_continues_plain_text_rows_from_their_first_tokens(target_dir, tmp_path, capsys):
    texts = ["def add(a, b):\n    return a + b\n" * 3, "x=1", "class Queue:\n    pass\n" * 4]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    assert run("--target", target_dir, "--data", data, "--out", out, "--max-new-tokens", 9, "--prompt-tokens", 5,
               "--batch-size", 2) == 0
    rows = {r["source_index"]: r for r in read(out)}
    assert sorted(rows) == [0, 1, 2] and "rows written 3" in capsys.readouterr().out
    for i, text in enumerate(texts):  # batched (left-padded: "x=1" is shorter than 5 tokens) = unbatched
        assert rows[i]["text"] == reference_continuation(target_dir, text, 5, 9)
        assert rows[i]["text"] != text and rows[i]["provenance"]["prompt_tokens"] == 5
    short = AutoTokenizer.from_pretrained(target_dir)(texts[1], add_special_tokens=False)["input_ids"]
    assert len(short) < 5 and rows[1]["text"].startswith("x=1")


# ------------------------------------------------------------------ a real OpenAI-compatible server


class ChatServer(ThreadingHTTPServer):
    """POST /v1/chat/completions with the target's chat template and greedy generate; answers the
    first request with 503 (to exercise retries) and prompts over SERVER_MAX_TOKENS with 400."""

    daemon_threads = True

    def __init__(self, target_dir):
        super().__init__(("127.0.0.1", 0), Handler)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.lock = threading.Lock()
        self.requests = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802 (http.server's name)
        server = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests += 1
            first = server.requests == 1
        if self.path != "/v1/chat/completions":
            return self.reply(404, {"error": {"message": f"no route {self.path}"}})
        if first:
            return self.reply(503, {"error": {"message": "warming up"}})
        tok = server.tokenizer
        text = tok.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] > SERVER_MAX_TOKENS:
            return self.reply(400, {"error": {"message": f"maximum context length is {SERVER_MAX_TOKENS} tokens"}})
        eos = server.model.generation_config.eos_token_id
        with server.lock, torch.inference_mode():
            out = server.model.generate(ids, max_new_tokens=request["max_tokens"], do_sample=False,
                                        pad_token_id=0)[0, ids.shape[1]:].tolist()
        stopped = eos in out
        out = out[: out.index(eos) + 1] if stopped else out
        content = tok.decode([t for t in out if t != eos], skip_special_tokens=True)
        self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": "stop" if stopped else "length"}],
                         "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(out)}})


@pytest.fixture(scope="module")
def server(target_dir):
    srv = ChatServer(target_dir)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_openai_engine_against_a_real_server_matches_the_hf_engine(target_dir, data_file, server, tmp_path, capsys):
    hf_out, api_out = tmp_path / "hf.jsonl", tmp_path / "api.jsonl"
    run("--target", target_dir, "--data", data_file, "--out", hf_out, "--max-new-tokens", 10, "--limit", 4)
    common = ("--target", target_dir, "--data", data_file, "--out", api_out, "--max-new-tokens", 10,
              "--engine", "openai", "--base-url", server, "--concurrency", 3, "--retries", 2)
    assert run(*common, "--limit", 2) == 0
    assert run(*common, "--resume") == 0
    report = capsys.readouterr().out
    assert "already there 2" in report
    assert "skipped not_a_conversation: 1" in report and "skipped server_error: 1" in report  # row 4: HTTP 400
    assert "maximum context length" in report  # the first error names the row and the server's reason
    api = {r["source_index"]: r for r in read(api_out)}
    hf = {r["source_index"]: r for r in read(hf_out)}
    assert sorted(api) == [0, 1, 3, 5]
    for i in (0, 1, 3):  # greedy answers are the same text whichever engine produced them
        # the hf engine's turns also keep the ids the target wrote (a server's reply has text only)
        assert all("token_ids" in m for m in hf[i]["messages"] if m["role"] == "assistant")
        assert api[i]["messages"] == [{"role": m["role"], "content": m["content"]} for m in hf[i]["messages"]]
    assert api[1]["provenance"]["engine"] == "openai"


def run_cli(*args):
    """Through data.entry_point.run, as ``python scripts/regenerate.py`` and ``draftsmith regenerate`` do."""
    return cli_run(main, [*map(str, args), "--no-progress"])


def test_openai_engine_stops_on_an_unreachable_server(target_dir, data_file, tmp_path, capsys):
    """Not exit 0 with every row 'skipped': the run stops, one line, exit code 2."""
    out = tmp_path / "out.jsonl"
    start = time.monotonic()
    code = run_cli("--target", target_dir, "--data", data_file, "--out", out, "--engine", "openai",
                   "--base-url", f"http://127.0.0.1:{closed_port()}/v1", "--retries", 1, "--limit", 4)
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 10
    assert err.startswith("error: stopped: cannot connect to http://127.0.0.1:") and err.count("\n") == 1
    assert "is the server running?" in err and "--resume continues" in err
    assert out.read_text() == ""


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """Accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_a_server_that_never_answers_ends_within_the_timeouts(target_dir, data_file, silent_server, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    common = ("--target", target_dir, "--data", data_file, "--out", out, "--engine", "openai",
              "--base-url", silent_server, "--concurrency", 1, "--connect-timeout", 1)
    start = time.monotonic()
    code = run_cli(*common, "--timeout", 0.3, "--retries", 0, "--max-failures", 2)
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 5
    assert "no answer from 127.0.0.1" in err and "/v1/models within 0.3 s" in err  # found before any request
    start = time.monotonic()
    code = run_cli(*common, "--timeout", 30, "--retries", 3, "--deadline", 0.8, "--concurrency", 4)  # 4 in flight
    assert code == 2 and time.monotonic() - start < 5
    assert "--deadline 0.8 s reached" in capsys.readouterr().err


def test_a_server_that_never_answers_is_named_in_seconds_with_the_defaults(target_dir, data_file, silent_server,
                                                                          tmp_path, capsys, monkeypatch):
    """With the defaults (--timeout 120, 4 retries) a silent server ran 10 minutes before a word: the
    GET /models probe names it after PROBE_SECONDS (shortened here)."""
    import draftsmith.data.regenerate
    from draftsmith import data

    monkeypatch.setattr(data.regenerate, "PROBE_SECONDS", 0.5)
    code = run_cli("--target", target_dir, "--data", data_file, "--out", tmp_path / "out.jsonl", "--engine", "openai",
                   "--base-url", silent_server)
    err = capsys.readouterr().err
    assert code == 2 and "/v1/models within 0.5 s: the server accepts connections but answers nothing" in err


def test_the_probe_lets_a_server_without_models_through(target_dir, data_file, scripted, tmp_path, capsys):
    """A server answering GET /models with an error (here 501: it serves POST only) is alive: the run goes on."""
    url = scripted([(200, completion("fine"), None)])
    code = run_cli("--target", target_dir, "--data", data_file, "--out", tmp_path / "out.jsonl", "--engine", "openai",
                   "--base-url", url, "--concurrency", 1, "--limit", 2)
    assert code == 0, capsys.readouterr().err


class ScriptedServer(ThreadingHTTPServer):
    """Answers POSTs with the raw replies in ``script`` (status, body bytes, declared length), in turn."""

    daemon_threads = True

    def __init__(self, script):
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.script, self.requests = script, 0


class ScriptedHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        status, body, length = server.script[server.requests % len(server.script)]
        server.requests += 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length if length is not None else len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True


@pytest.fixture
def scripted():
    servers = []

    def start(script):
        srv = ScriptedServer(script)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def completion(content):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]}).encode()


def test_bad_replies_fail_their_turn_with_one_clear_error(target_dir, data_file, scripted, tmp_path, capsys):
    """A cut body, content 42, not JSON: each a bad_reply skip with its reason, never a traceback."""
    url = scripted([(200, completion("ok")[:20], 200),  # declares 200 bytes, sends 20, closes
                    (200, completion(42), None),
                    (200, b"<html>Bad gateway</html>", None)])
    out = tmp_path / "out.jsonl"
    code = run_cli("--target", target_dir, "--data", data_file, "--out", out, "--engine", "openai",
                   "--base-url", url, "--concurrency", 1, "--limit", 4, "--timeout", 2)
    report = capsys.readouterr().out
    assert code == 0 and "skipped bad_reply: 3" in report
    assert out.read_text() == ""
    start = run_cli("--target", target_dir, "--data", data_file, "--out", tmp_path / "b.jsonl", "--engine", "openai",
                    "--base-url", scripted([(200, completion(42), None)]), "--limit", 1)
    assert start == 0 and "content is int 42, not a string" in capsys.readouterr().out


def test_a_server_answering_500_stops_after_max_failures(target_dir, data_file, scripted, tmp_path, capsys):
    url = scripted([(500, b'{"error": "boom"}', None)])
    out = tmp_path / "out.jsonl"
    code = run_cli("--target", target_dir, "--data", data_file, "--out", out, "--engine", "openai",
                   "--base-url", url, "--concurrency", 1, "--retries", 1, "--max-failures", 2)
    err = capsys.readouterr().err
    assert code == 2 and "2 conversations in a row failed" in err and "HTTP 500" in err and "after 1 retries" in err


@pytest.mark.parametrize("args, message", [
    (("--base-url", "notaurl", "--engine", "openai"), "is not an http(s) URL"),
    (("--base-url", "http://127.0.0.1:8000/v1", "--engine", "openai", "--retries", 1000), "at most 20"),
    (("--base-url", "http://127.0.0.1:8000/v1", "--engine", "openai", "--timeout", 0),
     "argument --timeout: a number > 0 expected, got '0'"),
    (("--base-url", "http://127.0.0.1:8000/v1", "--engine", "openai", "--deadline", "nan"),
     "argument --deadline: a number > 0 expected, got 'nan'"),
])
def test_bad_values_are_refused_at_parse_time(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        run("--target", "t", "--data", "d.json", "--out", tmp_path / "o.jsonl", *args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_out_is_never_the_data_file_nor_a_directory(data_file, tmp_path, capsys):
    before = data_file.read_bytes()
    for out in (data_file, data_file.parent / "." / data_file.name):
        with pytest.raises(SystemExit):
            run("--target", "t", "--data", data_file, "--out", out, "--resume")
        assert "is the --data file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("--target", "t", "--data", data_file, "--out", tmp_path)
    assert "is a directory" in capsys.readouterr().err
    assert data_file.read_bytes() == before


def test_resume_never_cuts_a_file_that_is_not_ours(target_dir, data_file, tmp_path, capsys):
    """The lines are checked before anything is cut: someone's notes without a final newline stay whole."""
    out = tmp_path / "notes.jsonl"
    out.write_bytes(b'{"note": "mine"}\nan unfinished last line')
    before = out.read_bytes()
    assert run_cli("--target", target_dir, "--data", data_file, "--out", out, "--resume") == 2
    assert "not a regenerated row" in capsys.readouterr().err
    assert out.read_bytes() == before
    out.write_bytes(b"just one line, no newline")  # no complete line: the cut line must look like ours
    assert run_cli("--target", target_dir, "--data", data_file, "--out", out, "--resume") == 2
    assert "does not begin like a regenerated row" in capsys.readouterr().err
    assert out.read_bytes() == b"just one line, no newline"


def test_the_script_ends_a_user_mistake_in_one_line(target_dir, data_file, tmp_path):
    out = tmp_path / "notes.jsonl"
    out.write_text("mine\n")
    done = subprocess.run([sys.executable, "scripts/regenerate.py", "--target", str(target_dir), "--data", str(data_file),
                           "--out", str(out), "--resume", "--no-progress", "--limit", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_conversation_plan_keeps_prompts_and_regenerated_history():
    plan = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}]
    conv = Conversation(0, "x", plan)
    assert conv.next_prompt() == plan[:2]
    conv.answer("new1")
    assert conv.next_prompt() == plan[:2] + [{"role": "assistant", "content": "new1"}, plan[3]]
    conv.answer("new2")
    assert conv.next_prompt() is None and conv.done[-1]["content"] == "new2"
