"""The quality measures: by hand on small distributions, the held-out text pinned, and the reference path."""

import hashlib
import math

import pytest
import torch

from kvcourse import quality as Q
from tests.tolerances import assert_logits_close


def test_heldout_text_is_the_same_on_every_python():
    # Checked byte for byte in CPython 3.10.13, 3.11.2, 3.11.7, 3.12.1 and 3.13.0: a change here means
    # this Python ships different help pages, and every measured number in chapter 8 would move.
    text = Q.heldout_text()
    assert (
        hashlib.sha256(text.encode()).hexdigest() == "835eaf851706fef93e95c0ffdefbcd826f210b7354adfa27d71ae1016570f5bc"
    )


def test_heldout_ids(tok):
    ids = Q.heldout_ids(tok, 50, offset=10)
    assert ids == tok.encode(Q.heldout_text())[10:60]
    with pytest.raises(ValueError, match="num_tokens"):
        Q.heldout_ids(tok, 1)
    with pytest.raises(ValueError, match="must fit"):
        Q.heldout_ids(tok, 10**6)


def test_perplexity_by_hand():
    uniform = torch.zeros(3, 8)
    assert Q.perplexity(uniform, [1, 2, 3]) == pytest.approx(8.0)
    # p(target) = 1/2 then 1/4: perplexity = exp(mean(log 2, log 4)) = sqrt(8)
    logits = torch.log(torch.tensor([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]]) + 1e-30)
    assert Q.perplexity(logits, [0, 3]) == pytest.approx(math.sqrt(8), rel=1e-6)
    with pytest.raises(ValueError, match="targets"):
        Q.perplexity(uniform, [1, 2])


def test_top1_and_kl_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]))
    got = torch.log(torch.tensor([[0.5, 0.5], [0.6, 0.4], [0.7, 0.3]]))
    assert Q.top1_agreement(got, ref) == pytest.approx(2 / 3)  # the tie goes to index 0 in both
    kl_row = 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    kl_row3 = 0.2 * math.log(0.2 / 0.7) + 0.8 * math.log(0.8 / 0.3)
    assert Q.kl_divergence(ref, got) == pytest.approx((0 + kl_row + kl_row3) / 3, rel=1e-5)
    assert Q.kl_divergence(ref, ref) == pytest.approx(0, abs=1e-7)
    q = Q.compare(got, ref, [0, 0, 1])
    assert q.ppl_change == pytest.approx(q.ppl / q.ref_ppl - 1) and q.num_tokens == 3
    with pytest.raises(ValueError, match=r"\[N, vocab\]"):
        Q.top1_agreement(got, ref[:2])


def test_greedy_agreement_counts_the_common_prefix():
    g = Q.GreedyAgreement(reference=[[1, 2, 3, 4], [5, 6], [7, 8, 9]], outputs=[[1, 2, 0, 4], [5, 6], [7, 8, 9, 10]])
    assert g.matched == [2, 2, 3]
    assert g.agreement == pytest.approx(7 / (4 + 2 + 4))
    assert g.identical == 1


def test_stream_logits_in_chunks_equal_one_prefill(model):
    ids = [1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28]
    whole = Q.stream_logits(model, ids)
    assert whole.shape == (11, model.config.vocab_size) and whole.dtype == torch.float32
    assert_logits_close(Q.stream_logits(model, ids, chunk_size=4), whole)
    with pytest.raises(ValueError, match="chunk_size"):
        Q.stream_logits(model, ids, chunk_size=0)


def test_needle_prompt(tok):
    hay = list(range(1000, 1100))
    p = Q.needle_prompt(tok, hay, 0.25, "4817")
    needle = tok.encode("\n\nThe secret code of the blue door is 4817.\n\n")
    assert p[:25] == hay[:25] and p[25 : 25 + len(needle)] == needle
    assert tok.decode(p).endswith("the secret code of the blue door is")
    assert Q.needle_prompt(tok, hay, 1.0, "1")[:100] == hay
    with pytest.raises(ValueError, match="depth"):
        Q.needle_prompt(tok, hay, 1.5, "1")
