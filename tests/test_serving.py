"""`hf-triforce serve` end to end on localhost: the real server joined to a real Ray cluster of two nodes, a replica
of a tiny model on each, the real ``openai`` client and plain HTTP. Greedy answers under concurrent load, decoded in
batches, equal the single-process ``generate(..., triforce_config=...)``; questions on one document reuse its
prefilled prefix on the replica that holds it, two documents on the two nodes; bad requests get HTTP 400 naming the
field; a replica killed while it streams gives its client an error, and the other node keeps answering while Ray
Serve brings the replica back."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from hf_triforce import TriForceConfig

from .serving_util import free_port, save_chat_model, start_server, stop_server

# small budgets, so that prompts of a few hundred tokens run all three tiers
TRIFORCE = {"retrieval_budget": 64, "chunk_size": 8, "window": 32}
NEW_TOKENS = 16
MODEL_NAME = "tiny-chat"


def _words(seed: int, length: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"t{int(i)}" for i in torch.randint(3, 90, (length,), generator=generator))


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of two nodes on this host (one CPU each, workers at this process's niceness)."""
    from ray.cluster_utils import Cluster

    niceness = {"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)}
    environment = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)  # the nodes' processes start with this process's environment
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                          "_system_config": niceness})
    try:
        nodes.add_node(num_cpus=1)
        yield nodes
    finally:
        nodes.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """``(base url, model, tokenizer)`` of a server joined to the two-node ``cluster``, a replica on each node
    (stopped at the module's end)."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    model, tokenizer = save_chat_model(folder)
    port = free_port()
    process = start_server([str(folder), "--address", cluster.address, "--replicas", "2",
                            "--max-replicas-per-node", "1", "--proxy-location", "HeadOnly", "--threads", "1",
                            "--served-model-name", MODEL_NAME, "--prefix-min-tokens", "16",
                            "--triforce-config", json.dumps(TRIFORCE)], port, folder / "server.log")
    try:
        yield f"http://127.0.0.1:{port}", model, tokenizer
    finally:
        stop_server(process)


def _running_replicas(address: str) -> int:
    """Replicas Ray Serve's controller reports running (asked from a driver process of its own)."""
    script = (f"import ray; from ray import serve; ray.init(address={address!r}, log_to_driver=False); "
              "print(serve.status().applications['hf-triforce'].deployments['TriForceServer']"
              ".replica_states.get('RUNNING', 0))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_ids(tokenizer, content: str) -> torch.Tensor:
    return torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]])


def _reference(model, tokenizer, ids: torch.Tensor, stop: list[str] | None = None) -> str:
    stopping = {"stop_strings": stop, "tokenizer": tokenizer} if stop else {}
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                         triforce_config=TriForceConfig(**TRIFORCE), **stopping)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _ask(client, kind: str, content: str, stream: bool, document: str | None = None) -> tuple[str, str, dict]:
    """``(text, finish_reason, usage extension)`` of one greedy request."""
    headers = {"serve_multiplexed_model_id": document} if document else None
    common = dict(model=MODEL_NAME, max_tokens=NEW_TOKENS, temperature=0, extra_headers=headers)
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        response = client.chat.completions.create(messages=[{"role": "user", "content": content}], stream=stream,
                                                  **common)
    else:
        response = client.completions.create(prompt=content, stream=stream, **common)
    if not stream:
        choice = response.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, choice.finish_reason, response.usage.model_extra["triforce"]
    text, finish, extension = "", None, None
    for chunk in response:
        if chunk.usage is not None:
            extension = chunk.usage.model_extra["triforce"]
        for choice in chunk.choices:
            text += (choice.delta.content or "") if kind == "chat" else (choice.text or "")
            finish = choice.finish_reason or finish
    return text, finish, extension


def test_concurrent_greedy_answers_equal_generate(served):
    """32 requests from 8 concurrent clients (chat and text, streamed and not) over 2 replicas: every one answered,
    each equal to the single-process TriForce answer."""
    url, model, tokenizer = served
    documents = [_words(seed, 160) for seed in range(4)]
    requests = [(("chat", "text")[i % 2], f"{documents[i % 4]} {_words(100 + i % 4, 6)}", bool(i // 8 % 2))
                for i in range(32)]
    expected = {}
    for kind, content, _ in requests:
        if (kind, content) not in expected:
            ids = _chat_ids(tokenizer, content) if kind == "chat" else tokenizer(content, return_tensors="pt").input_ids
            expected[kind, content] = _reference(model, tokenizer, ids)
    clients = [_client(url) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda item: _ask(clients[item[0] % 8], *item[1]), enumerate(requests)))
    assert len(answers) == 32
    for (kind, content, stream), (text, finish, extension) in zip(requests, answers):
        assert finish == "length", (kind, stream)
        assert text == expected[kind, content], (kind, stream)
        assert extension["enabled"] and extension["decode_tokens_per_second"] > 0
        assert set(extension["plan_steps"]) and 0.0 <= extension["force3_acceptance"] <= 1.0  # its own statistics
        assert extension["stats"]["new_tokens"] == NEW_TOKENS
    batched = [extension["batch"]["rows"] for _, _, extension in answers]
    assert max(batched) >= 2, batched  # concurrent requests on a replica decoded together
    replicas = {}
    for _ in range(20):  # each replica's latest batches
        figures = httpx.get(f"{url}/v1/triforce/replica", timeout=30).json()
        replicas[figures["replica"]] = figures
    assert all(figures["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) for figures in replicas.values())
    batches = [batch for figures in replicas.values() for batch in figures["batches"]]
    assert batches and all(batch["requests"] >= batch["rows"] >= 1 for batch in batches)
    assert sum(batch["requests"] for batch in batches) <= 32


def test_document_routing_and_prefix_reuse(served):
    """Questions on two documents, each sent with its id: a document's questions reach one replica and reuse its
    prefilled prefix, the two documents are held on the two nodes; the answers equal fresh single-process ones."""
    url, model, tokenizer = served
    client = _client(url)
    documents = {f"document-{seed}": _words(seed, 300) for seed in (7, 8)}
    replicas = {name: set() for name in documents}
    reused = {name: [] for name in documents}
    for question in range(4):
        for name, document in documents.items():
            content = f"{document} {_words(200 + question, 5)}"
            response = client.chat.completions.with_raw_response.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=NEW_TOKENS,
                temperature=0, extra_headers={"serve_multiplexed_model_id": name})
            replicas[name].add(response.headers["x-triforce-replica"])
            completion = response.parse()
            reused[name].append(completion.usage.prompt_tokens_details.cached_tokens)
            expected = _reference(model, tokenizer, _chat_ids(tokenizer, content))
            assert completion.choices[0].message.content == expected
    assert all(len(held) == 1 for held in replicas.values()), replicas
    nodes = {}
    for name in documents:  # the replica holding a document answers a request with its id
        figures = httpx.get(f"{url}/v1/triforce/replica", headers={"serve_multiplexed_model_id": name},
                            timeout=30).json()
        nodes[name] = figures["replica"], figures["node"]
    assert {name: {replica} for name, (replica, _) in nodes.items()} == replicas
    assert len({replica for replica, _ in nodes.values()}) == len({node for _, node in nodes.values()}) == 2, nodes
    for counts in reused.values():
        assert counts[0] == 0 and all(r >= 300 for r in counts[1:]), reused


def test_sampling_honours_seed_and_stop(served):
    url, model, tokenizer = served
    client = _client(url)
    content = _words(11, 120)
    sampled = [client.completions.create(model=MODEL_NAME, prompt=content, max_tokens=16, temperature=0.9, top_p=0.95,
                                         seed=seed, extra_body={"triforce": {"policy": "fixed"}}).choices[0].text
               for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    greedy = _ask(client, "text", content, stream=False)[0].split()
    stop = greedy[5]
    text = client.completions.create(model=MODEL_NAME, prompt=content, max_tokens=NEW_TOKENS, temperature=0,
                                     stop=stop).choices[0]
    ids = tokenizer(content, return_tensors="pt").input_ids
    assert text.text == _reference(model, tokenizer, ids, stop=[stop])
    assert text.text.split()[-1] == stop and len(text.text.split()) == greedy.index(stop) + 1
    assert text.finish_reason == "stop"


BAD = [
    ({"model": "other-model"}, "model"),
    ({"n": 2}, "n must be 1"),
    ({"temperature": -0.5}, "temperature"),
    ({"triforce": {"gama1": 2}}, "gama1"),
    ({"triforce": {"gamma1": 0}}, "gamma1"),
    ({"triforce": {"draft": "bogus"}}, "draft"),
    ({"max_tokens": 4000}, "max_tokens"),
    ({"generation_config": "{not json"}, "generation_config"),
    ({"generation_config": '{"num_beams": 2}'}, "num_beams"),  # refused by generate(triforce_config=...)
    ({"messages": [{"role": "user", "content": _words(3, 2100)}]}, "2048"),
]


@pytest.mark.parametrize("change,named", BAD, ids=[named for _, named in BAD])
def test_bad_requests_get_400_naming_the_field(served, change, named):
    url, _, _ = served
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 4, **change}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert named in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2}).status_code == 200


def test_a_stream_that_fails_ends_in_an_error(served):
    """A generation refused once streaming has begun: the client gets the error, and no finishing chunk."""
    url, _, _ = served
    stream = _client(url).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "t5 t6"}], max_tokens=4, stream=True,
        extra_body={"generation_config": json.dumps({"num_beams": 2})})
    finished = []
    with pytest.raises(openai.APIError, match="num_beams"):
        for chunk in stream:
            finished += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
    assert not finished


def test_models_route(served):
    url, _, _ = served
    assert [m.id for m in _client(url).models.list()] == [MODEL_NAME]


def test_replica_killed_while_streaming(served, cluster):
    """The client of a stream whose replica dies gets an error and no finished answer; the other node's replica
    keeps answering; Ray Serve starts a replacement (the proxy prefers its own node's replica, so the controller,
    not routed requests, tells)."""
    url, _, _ = served
    client = _client(url)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "t5 t6 t7"}], max_tokens=1500, temperature=0,
        stream=True)
    killed = raw.headers["x-triforce-replica"]
    chunks, finished = 0, []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for chunk in raw.parse():
            chunks += 1
            if chunks == 3:
                os.kill(int(killed.split(":")[1]), signal.SIGKILL)
            finished += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
    assert chunks >= 3 and not finished
    for _ in range(4):  # served meanwhile, by the replica left
        assert _ask(client, "chat", "t5 t6 t8", stream=False)[1] == "length"
    deadline = time.monotonic() + 90
    while (running := _running_replicas(cluster.address)) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert running == 2
