"""The demo GPT, the toy MLP and the stdlib byte corpus: shapes, determinism, learning."""

import math

import pytest
import torch

from zerodist.data import MIN_CORPUS_BYTES, TokenDataset, split_corpus, stdlib_corpus
from zerodist.models import GPT, GPT_PRESETS, GPTConfig, count_parameters, gpt_config, make_mlp

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(max_bytes=300_000)


def _seeded_gpt(name, seed=0):
    torch.manual_seed(seed)
    return GPT(gpt_config(name))


# --- models ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 30_000, 60_000), ("small", 800_000, 1_200_000), ("bench", 800_000, 1_200_000), ("bench-25m", 20e6, 30e6)],
)
def test_preset_parameter_counts(name, low, high):
    config = gpt_config(name)
    model = GPT(config)
    assert low <= count_parameters(model) == model.num_parameters() <= high
    assert len(model.blocks) == config.n_layers and config.d_ff == 4 * config.d_model


def test_presets_and_config_validation():
    assert gpt_config("small") == GPTConfig() and gpt_config("tiny").seq_len == 32
    assert gpt_config("small", seq_len=64).seq_len == 64
    with pytest.raises(ValueError, match="tiny, small, bench, bench-25m"):
        gpt_config("huge")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_heads=4)
    assert set(GPT_PRESETS) == {"tiny", "small", "bench", "bench-25m"}


def test_same_seed_same_weights():
    a, b, c = _seeded_gpt("tiny", 0), _seeded_gpt("tiny", 0), _seeded_gpt("tiny", 1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    assert all(torch.count_nonzero(blk.mlp.fc_in.bias) == 0 for blk in a.blocks)


def test_forward_shapes_and_initial_loss():
    model = _seeded_gpt("tiny")
    seq = model.config.seq_len
    idx = torch.randint(0, 256, (2, seq))
    assert model(idx).shape == (2, seq, 256)
    loss = model(idx, idx.roll(-1, dims=1))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(256)) < 0.1
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, seq + 1, dtype=torch.long))


def test_tied_embeddings_share_one_tensor():
    model = GPT(gpt_config("tiny", tie_embeddings=True))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_parameters() == GPT(gpt_config("tiny")).num_parameters() - 256 * 32


def test_causal_future_tokens_do_not_change_past_logits():
    model = _seeded_gpt("tiny").eval()
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_tiny_gpt_overfits_a_fixed_batch(corpus):
    model = _seeded_gpt("tiny")
    dataset = TokenDataset(corpus, seq_len=32)
    x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(4))))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model(x, y).item()
    for _ in range(150):
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
    assert loss.item() < first / 2, (first, loss.item())


def test_make_mlp_is_deterministic_and_needs_padding():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = make_mlp(), make_mlp(), make_mlp(seed=1)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a[0].weight, c[0].weight)
    assert any(p.numel() % 2 and p.numel() % 3 for p in a.parameters())
    assert a(torch.randn(5, 16)).shape == (5, 8)
    assert len(make_mlp(layers=1)) == 1


# --- data -----------------------------------------------------------------------------------


def test_corpus_is_deterministic_bytes(corpus):
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1 and len(corpus) == 300_000
    assert torch.equal(corpus, stdlib_corpus(max_bytes=300_000))
    assert not torch.equal(corpus, stdlib_corpus(max_bytes=300_000, seed=1))
    text = bytes(corpus[:5000].tolist())
    assert b"def " in text or b"class " in text or b"import " in text


def test_corpus_too_small_names_the_path(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        stdlib_corpus(root=tmp_path)
    assert len(stdlib_corpus(max_bytes=4, root=tmp_path)) == 4  # a small request is still served
    assert MIN_CORPUS_BYTES == 100_000


def test_token_dataset_windows(corpus):
    dataset = TokenDataset(corpus, seq_len=128)
    assert len(dataset) == (len(corpus) - 1) // 128
    x, y = dataset[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (128,)
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(x, corpus[384:512].long()) and y[-1] == corpus[512]
    last_x, last_y = dataset[-1]
    assert torch.equal(last_x, dataset[len(dataset) - 1][0]) and len(last_y) == 128
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    with pytest.raises(ValueError, match="no full window"):
        TokenDataset(corpus[:128], seq_len=128)


def test_split_corpus(corpus):
    train, val = split_corpus(corpus, val_fraction=0.1)
    assert len(val) == len(corpus) // 10 and len(train) + len(val) == len(corpus)
    assert torch.equal(torch.cat([train, val]), corpus)
    with pytest.raises(ValueError):
        split_corpus(corpus, val_fraction=1.0)
