"""The coordinator's OpenAI-compatible HTTP API through the official `openai` client: completions and chat,
sync, async and streaming, 8 concurrent clients, output equal to the verifier's greedy one and to the gRPC
SDK's seeded one, stop sequences, every error status, and a mid-stream disconnect freeing the session on
every service. Real servers on loopback (tiny pair, in a background event loop)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from coord_helpers import greedy_reference
from coordinator.http_api.http_server import start_http
from coordinator.local import LocalCluster
from coordinator.quotas import SessionQuota
from coordinator.server import Coordinator
from loop_thread import LoopThread
from steerspec.serving.linkemu import NO_LINK, LinkModel
from steerspec.serving.security import ServerSecurity

PROMPT = "def fibonacci(n):"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Served:
    """A LocalCluster with its HTTP API, run on a background loop; `client()` is an openai.OpenAI for it."""

    def __init__(self, verifier, drafter) -> None:
        self.thread = LoopThread()
        self.cluster = LocalCluster(str(verifier), str(drafter), eos_ids=(), http_port=0)
        self.thread.run(self.cluster.start())
        self.url = self.cluster.http_url + "/v1"
        self.model = self.client().models.list().data[0].id
        self.tokenizer = self.cluster.coordinator.tokenizer

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0)

    def greedy_text(self, prompt_text: str, n: int) -> str:
        ids = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(greedy_reference(self.cluster.verifier, ids, n), skip_special_tokens=True)

    def stats(self):
        return self.thread.run(self.cluster.stats())

    def close(self) -> None:
        self.thread.run(self.cluster.stop())
        self.thread.close()


@pytest.fixture(scope="module")
def served(tiny_pair):
    s = Served(*tiny_pair)
    yield s
    s.close()


@pytest.fixture(scope="module")
def chat_served(tiny_pair, tmp_path_factory):
    """The tiny verifier with a chat template in its tokenizer (the drafter pairs with it: same tokenizer)."""
    verifier = tmp_path_factory.mktemp("chat") / "verifier"
    shutil.copytree(tiny_pair[0], verifier)
    tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(verifier))
    s = Served(verifier, tiny_pair[1])
    yield s
    s.close()


def _status(exc_info) -> int:
    return exc_info.value.status_code


def _error_param(exc_info):
    return exc_info.value.body.get("param") if isinstance(exc_info.value.body, dict) else None


# ------------------------------------------------------------------------------------------------ outputs


def test_models_health_and_a_greedy_completion_equal_to_the_verifier_alone(served):
    models = served.client().models.list().data
    assert [m.id for m in models] == [served.cluster.coordinator.model_name] and models[0].owned_by == "steerspec"
    with urllib.request.urlopen(served.cluster.http_url + "/health", timeout=10) as reply:
        assert reply.status == 200 and json.loads(reply.read())["verifiers"] == 1
    out = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"k": 3})
    assert out.choices[0].text == served.greedy_text(PROMPT, 12)
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(served.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 12)
    spec = out.metrics["speculative_decoding"]  # vLLM's per-request layout
    assert spec["num_spec_tokens"] == 3 and len(spec["acceptance_histogram"]) == 4
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) == len(spec["per_step_drafted"])
    assert 0 < spec["num_spec_steps"] <= out.metrics["steerspec"]["round_trips"]  # blocks without drafts left out
    assert spec["num_accepted_draft_tokens"] == sum(spec["per_step_accepted"])
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])
    remote = out.metrics["steerspec"]
    assert remote["bytes_up"] > 0 and remote["rtt_ms"] > 0 and set(remote["stage_ms"]) >= {"draft", "verify"}
    assert out.metrics["time_to_first_token_ms"] > 0


def test_streaming_completion_ends_with_usage_and_done(served):
    want = served.greedy_text(PROMPT, 10)
    stream = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].metrics["speculative_decoding"]["num_draft_tokens"] > 0
    body = json.dumps({"model": served.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True})
    request = urllib.request.Request(served.url + "/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        events = [line for line in reply.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_sync_and_streaming_use_the_models_chat_template(chat_served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"}]
    rendered = chat_served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = chat_served.greedy_text(rendered, 8)
    out = chat_served.client().chat.completions.create(model=chat_served.model, messages=messages, max_tokens=8,
                                                       temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.usage.completion_tokens == 8
    stream = chat_served.client().chat.completions.create(model=chat_served.model, messages=messages, max_tokens=8,
                                                          temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_async_clients_eight_at_once_each_get_the_verifiers_greedy_output(chat_served):
    prompts = [f"def f{i}(x):" for i in range(8)]
    wants = [chat_served.greedy_text(p, 8) for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(model=chat_served.model, prompt=prompt, max_tokens=8,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    clients = [chat_served.aclient() for _ in prompts]
    try:
        got = await asyncio.wait_for(asyncio.gather(*(one(c, p) for c, p in zip(clients, prompts))), 60)
        chat = await clients[0].chat.completions.create(
            model=chat_served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    finally:
        for client in clients:
            await client.close()
    assert got == wants
    assert chat.usage.completion_tokens == 4


def test_seeded_sampling_equals_the_grpc_sdks(served):
    kwargs = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    out = served.client().completions.create(model=served.model, prompt=PROMPT, extra_body={"k": 4}, **kwargs)
    with served.cluster.client() as sdk:
        summary = sdk.complete(PROMPT, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234, k=4, timeout=60)
    assert out.choices[0].text == summary.text
    assert out.usage.completion_tokens == len(summary.token_ids) == 12


def test_stop_sequences_end_the_text_before_the_match_over_http_and_grpc(served):
    full = served.greedy_text(PROMPT, 16)
    stop = full[5:8]  # a stop string in the middle of the greedy text
    want = full[:full.index(stop)]
    out = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                             stop=[stop, "\x00never"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16
    stream = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                stop=stop, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    with served.cluster.client() as sdk:
        items = list(sdk.generate(PROMPT, max_new_tokens=16, stop=stop, timeout=60))
    summary = items[-1]
    assert summary.finish_reason == "stop" and summary.text == want
    assert "".join(i.text for i in items[:-1]) == want
    never = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                               stop=full[-2:] + "\x01", stream=True)  # held back, then released
    assert "".join(c.choices[0].text for c in never if c.choices) == full


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"), ({"temperature": -1}, "temperature"),
    ({"extra_body": {"verification": "sprinter"}}, None), ({"extra_body": {"tree": "0,x"}}, None),
    ({"stop": [""]}, None),
])
def test_unsupported_or_bad_parameters_are_400_naming_the_parameter(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=4, **kwargs)
    assert _status(err) == 400
    if param is not None:
        assert _error_param(err) == param and param in err.value.message


def test_chat_without_a_template_unknown_model_and_tokens_are_400_404_401(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(model=served.model, messages=[{"role": "user", "content": "x"}])
    assert "no chat template" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        served.client().completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert served.model in err.value.message
    guarded = served.thread.run(start_http(served.cluster.coordinator, port=0,
                                           server_security=ServerSecurity(tokens=frozenset({"s3cret"}))))
    try:
        url = guarded.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        out = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).completions.create(
            model=served.model, prompt=PROMPT, max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
    finally:
        served.thread.run(guarded.stop())


def test_quota_deadline_and_no_verifier_are_429_504_503(served):
    coordinator = served.cluster.coordinator
    served.cluster.set_link(LinkModel(rtt_ms=20))
    quota, coordinator.quota = coordinator.quota, SessionQuota(1)
    try:
        stream = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=100, stream=True)
        next(iter(stream))  # one session running
        with pytest.raises(openai.RateLimitError) as err:
            served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=2)
        assert "--max-sessions-per-identity 1" in err.value.message
        stream.close()
        coordinator.quota = quota
        with pytest.raises(openai.APIStatusError) as err:
            served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=100,
                                               extra_body={"timeout": 0.1})
        assert _status(err) == 504
    finally:
        coordinator.quota = quota
        served.cluster.set_link(NO_LINK)
    lonely = Coordinator(follow_verifier=True)  # no verifier anywhere: nothing to serve
    http = served.thread.run(start_http(lonely, port=0))
    try:
        client = openai.OpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="any", prompt=PROMPT, max_tokens=2)
        assert _status(err) == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(http.url + "/health", timeout=10)
        assert health.value.code == 503
    finally:
        served.thread.run(http.stop())


def test_a_client_that_disconnects_mid_stream_ends_the_session_on_every_service(served):
    served.cluster.set_link(LinkModel(rtt_ms=50))  # 200 tokens, at most 3 a round trip: >= 3.3 s to the end
    try:
        stream = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=200,
                                                    temperature=0, stream=True, extra_body={"k": 2})
        chunks = iter(stream)
        next(chunks), next(chunks)
        verifiers, drafters = served.stats()
        assert verifiers[0].active_sessions == 1 and drafters[0].active_sessions == 1
        assert verifiers[0].cache_bytes > 0
        stream.close()  # the client goes away mid-generation
        deadline = time.monotonic() + 1.5  # well before the generation could have ended by itself
        while time.monotonic() < deadline:
            verifiers, drafters = served.stats()
            if not (verifiers[0].active_sessions or drafters[0].active_sessions or verifiers[0].cache_bytes
                    or served.cluster.coordinator.quota.running):
                break
            time.sleep(0.05)
        assert (verifiers[0].active_sessions, drafters[0].active_sessions) == (0, 0)
        assert verifiers[0].cache_bytes == 0 and drafters[0].cache_bytes == 0
        assert not served.cluster.coordinator.quota.running
    finally:
        served.cluster.set_link(NO_LINK)


@pytest.mark.slow
def test_tls_and_mutual_tls_with_the_coordinators_certificates(served, tmp_path):
    import ssl

    from pki_helpers import make_pki
    from steerspec.serving import security

    pki = make_pki(tmp_path, "tok")
    cert, key = pki["server"]
    for mutual in (False, True):
        server = security.server_security(cert, key, pki["ca"] if mutual else None, pki["tokens"])
        http = served.thread.run(start_http(served.cluster.coordinator, port=0, server_security=server))
        try:
            assert http.url.startswith("https://")
            context = ssl.create_default_context(cafile=pki["ca"])
            if mutual:
                context.load_cert_chain(*pki["client"])
            client = openai.OpenAI(base_url=http.url + "/v1", api_key="tok", max_retries=0,
                                   http_client=openai.DefaultHttpxClient(verify=context))
            out = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0)
            assert out.choices[0].text == served.greedy_text(PROMPT, 3)
            plain = openai.OpenAI(base_url=http.url + "/v1", api_key="tok", max_retries=0,
                                  http_client=openai.DefaultHttpxClient(
                                      verify=ssl.create_default_context(cafile=pki["ca"])))
            if mutual:  # no client certificate: the handshake fails
                with pytest.raises(openai.APIConnectionError):
                    plain.models.list()
            else:
                assert plain.models.list().data[0].id == served.model
        finally:
            served.thread.run(http.stop())


def test_the_ray_deployments_coordinator_serves_the_http_api(served):
    """The Ray actor's class (coordinator/ray_app.CoordinatorServer, run here without Ray) with http_port."""
    from coordinator.ray_app import CoordinatorServer

    actor = CoordinatorServer(verifiers=served.cluster.verifier_targets, drafters=served.cluster.drafter_targets,
                              tokenizer=str(served.cluster.verifier), http_port=0)
    served.thread.run(actor.start())
    try:
        url = actor.http_url()
        assert url.startswith("http://127.0.0.1:")
        out = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
            model=served.model, prompt=PROMPT, max_tokens=6, temperature=0)
        assert out.choices[0].text == served.greedy_text(PROMPT, 6)
    finally:
        served.thread.run(actor.stop())
