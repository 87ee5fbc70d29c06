"""Packing invariants over random document and sequence lengths (hypothesis), and exact resume at any point."""

import grain
import numpy as np
from hypothesis import given, settings, strategies as st

from maxctx.data import packing

STRIDE = 1 << 12  # Token value = document × STRIDE + index, so every pair names its document and place.


def _docs(lengths):
  return [(d * STRIDE + np.arange(n)).astype(np.int32) for d, n in enumerate(lengths)]


def _packed(lengths, seq_len, method, long_documents, bins):
  parent = grain.MapDataset.source(_docs(lengths)).to_iter_dataset(grain.ReadOptions(num_threads=0))
  return packing.PackIterDataset(parent, seq_len, method, long_documents, bins)


cases = st.tuples(
    st.lists(st.integers(0, 200), max_size=40),
    st.integers(1, 64),
    st.sampled_from(["first_fit", "concat"]),
    st.sampled_from(["split", "truncate"]),
    st.integers(1, 4),
)


@settings(max_examples=150, deadline=None)
@given(cases)
def test_packing_invariants(case):
  lengths, seq_len, method, long_documents, bins = case
  seqs = list(_packed(lengths, seq_len, method, long_documents, bins))
  seen = []
  for i, s in enumerate(seqs):
    assert set(s) == set(packing.FIELDS)
    assert all(v.shape == (seq_len,) and v.dtype == np.int32 for v in s.values())
    seg, pos, tok, tgt = s["segment_ids"], s["positions"], s["tokens"], s["targets"]
    real = seg != 0
    n = int(real.sum())
    assert n > 0 and real[:n].all() and not real[n:].any(), "padding only at the end"
    assert not (tok[n:].any() or tgt[n:].any() or pos[n:].any()), "padding is all zeros"
    assert seg[0] == 1 and set(np.diff(seg[:n])) <= {0, 1}, "segment ids run 1..k, contiguous"
    for k in range(1, seg[n - 1] + 1):
      idx = np.flatnonzero(seg == k)
      assert (pos[idx] == np.arange(len(idx))).all(), "positions restart at 0 in each piece"
      assert (tgt[idx] == tok[idx] + 1).all() and (np.diff(tok[idx]) == 1).all(), "a piece is consecutive pairs"
      assert len({int(t) // STRIDE for t in tok[idx]}) == 1, "a piece belongs to one document"
    seen += tok[real].tolist()
    if method == "concat" and i < len(seqs) - 1:
      assert n == seq_len, "concat pads only the last sequence"
  pairs = lambda L: min(L - 1, seq_len) if long_documents == "truncate" else L - 1
  expected = sorted(d * STRIDE + j for d, L in enumerate(lengths) for j in range(max(0, pairs(L))))
  assert sorted(seen) == expected, "every pair exactly once"


@settings(max_examples=60, deadline=None)
@given(cases, st.integers(0, 30))
def test_packing_resumes_exactly(case, cut):
  lengths, seq_len, method, long_documents, bins = case
  ds = _packed(lengths, seq_len, method, long_documents, bins)
  full = list(ds)
  cut = min(cut, len(full))
  it = iter(ds)
  for _ in range(cut):
    next(it)
  state = it.get_state()
  resumed = iter(ds)
  resumed.set_state(state)
  rest = list(resumed)
  assert len(rest) == len(full) - cut
  for a, b in zip(rest, full[cut:]):
    for k in packing.FIELDS:
      np.testing.assert_array_equal(a[k], b[k])


@settings(max_examples=60, deadline=None)
@given(cases, st.integers(0, 30))
def test_a_mixtures_per_source_counts_match_its_pairs_and_leave_the_fields_alone(case, cut):
  # Documents given as (document, source index), source = document % 3: each sequence's SOURCE_TOKENS must equal
  # its non-padding pairs counted by source (read off the targets), however pieces split across sequences and
  # rounds, after a resume too; and the fields must be those of the same documents given plain.
  lengths, seq_len, method, long_documents, bins = case
  parent = grain.MapDataset.source([(doc, d % 3) for d, doc in enumerate(_docs(lengths))])
  ds = packing.PackIterDataset(parent.to_iter_dataset(grain.ReadOptions(num_threads=0)), seq_len, method,
                               long_documents, bins, sources=3)
  tagged, plain = list(ds), list(_packed(lengths, seq_len, method, long_documents, bins))
  assert len(tagged) == len(plain)
  for t, p in zip(tagged, plain):
    assert set(t) == {*packing.FIELDS, packing.SOURCE_TOKENS}
    for k in packing.FIELDS:
      np.testing.assert_array_equal(t[k], p[k])
    real = t["segment_ids"] != 0
    np.testing.assert_array_equal(t[packing.SOURCE_TOKENS], np.bincount(t["targets"][real] // STRIDE % 3,
                                                                        minlength=3))
  cut = min(cut, len(tagged))
  it = iter(ds)
  for _ in range(cut):
    next(it)
  resumed = iter(ds)
  resumed.set_state(it.get_state())
  for a, b in zip(resumed, tagged[cut:], strict=True):
    np.testing.assert_array_equal(a[packing.SOURCE_TOKENS], b[packing.SOURCE_TOKENS])


def test_first_fit_fills_earlier_sequences():
  # Pieces of 5, 6, 3 pairs at seq_len 8 with 2 open sequences: the 3 goes back into the first one.
  seqs = list(_packed([6, 7, 4], 8, "first_fit", "split", 2))
  assert [s["segment_ids"].tolist() for s in seqs] == [[1] * 5 + [2] * 3, [1] * 6 + [0] * 2]


def test_long_documents_split_into_pieces_of_their_own():
  (s0, s1, s2), = [list(_packed([21], 8, "first_fit", "split", 1))]
  assert [int((s["segment_ids"] > 0).sum()) for s in (s0, s1, s2)] == [8, 8, 4]
  np.testing.assert_array_equal(s1["positions"], np.arange(8))
  assert s1["tokens"][0] == 8 and s1["targets"][-1] == 16


def test_write_sequence_matches_definition():
  pieces = [np.arange(5, dtype=np.int32), np.arange(10, 13, dtype=np.int32)]
  s = packing.write_sequence(pieces, 10)
  np.testing.assert_array_equal(s["tokens"], [0, 1, 2, 3, 10, 11, 0, 0, 0, 0])
  np.testing.assert_array_equal(s["targets"], [1, 2, 3, 4, 11, 12, 0, 0, 0, 0])
  np.testing.assert_array_equal(s["segment_ids"], [1, 1, 1, 1, 2, 2, 0, 0, 0, 0])
  np.testing.assert_array_equal(s["positions"], [0, 1, 2, 3, 0, 1, 0, 0, 0, 0])
