"""/v1/embeddings through the official client, and /tokenize, /detokenize, against the real server."""

import base64

import httpx
import numpy as np
import pytest
import torch

from tests.backend.server_process import ServerProcess

LONG = "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } and the scribe copied it all"
TEXTS = ["The scribe copied the manuscript", "Paged attention keeps the cache in blocks", "A quick apprentice"]


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(str(model_dir), "--served-model-name", "tiny", "--block-size", "8", "--max-model-len", "256",
                         "--max-num-batched-tokens", "16")  # inputs longer than a step run in chunks
    yield proc
    assert proc.stop() == 0


def reference(model_dir, text: str) -> np.ndarray:
    """transformers' last hidden state (after the final norm), mean-pooled and normalised."""
    from transformers import AutoModel, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)(ids).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()


def test_embeddings_shape_norm_batches_and_oracle(client, model_dir):
    out = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == [0, 1, 2] and vectors.shape == (3, 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    np.testing.assert_allclose(vectors[0], reference(model_dir, TEXTS[0]), atol=1e-4)
    long = client.embeddings.create(model="tiny", input=LONG, encoding_format="float")  # several prefill chunks
    assert long.usage.prompt_tokens > 40
    np.testing.assert_allclose(long.data[0].embedding, reference(model_dir, LONG), atol=1e-4)
    other = client.embeddings.create(model="tiny", input=[TEXTS[2], "something else entirely", TEXTS[0]],
                                     encoding_format="float")
    np.testing.assert_allclose(other.data[2].embedding, vectors[0], atol=1e-5)  # same text, another batch
    np.testing.assert_allclose(other.data[0].embedding, vectors[2], atol=1e-5)
    alone = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float").data[0].embedding
    assert float(np.dot(alone, alone)) == pytest.approx(1.0, abs=1e-5)
    assert float(np.dot(alone, vectors[0])) == pytest.approx(1.0, abs=1e-5)


def test_embeddings_of_token_ids_and_base64(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, by_text, atol=1e-6)


def test_models_says_how_embeddings_are_made(client):
    model = client.models.list().data[0]
    assert model.embedding == {"pooling": "mean", "normalized": True, "source": "last hidden state",
                               "dimensions": 64}


def test_tokenize_and_detokenize(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": TEXTS[0]}).json()
    assert r["tokens"] == tok(TEXTS[0]).input_ids and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.decode(r["tokens"])


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2, 99999]]}, "input"),
    ("/v1/embeddings", {"input": [list(range(3, 300))]}, "input"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_inputs_are_400(server, path, payload, param):
    r = httpx.post(f"{server.url}{path}", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embedding_between_steps_leaves_running_generations_alone(client):
    """Embeddings take free KV blocks of their own, so a generation running meanwhile is unchanged."""
    import threading

    kwargs = dict(model="tiny", messages=[{"role": "user", "content": TEXTS[0]}], max_tokens=60, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    pieces, done = [], threading.Event()

    def read():
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        done.set()

    reader = threading.Thread(target=read)
    reader.start()
    while not done.is_set():
        client.embeddings.create(model="tiny", input=[LONG, TEXTS[1]] * 4)
    reader.join()
    assert "".join(pieces) == expected
