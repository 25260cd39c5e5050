"""Paged attention with node-mass output, every backend against a brute-force float64 oracle."""
import importlib
from dataclasses import replace

import pytest
import torch

from nodekv.kernels import reference
from conftest import needs_triton_interpreter
from paged_cases import brute_force, make_batch, make_case, record_attention_tiles

# backend name -> module whose paged_attention is tested (Triton runs under TRITON_INTERPRET=1 on CPU, see conftest)
MODULES = {"reference": "nodekv.kernels.reference", "cpu": "nodekv.kernels.cpu_ops",
           "triton": "nodekv.kernels.triton_attention"}
BACKENDS = {name: lambda *a, _m=mod: importlib.import_module(_m).paged_attention(*a) for name, mod in MODULES.items()}
# parameters of the tests below: the CPU tensors here reach Triton only through its interpreter
NAMES = [pytest.param(n, marks=needs_triton_interpreter) if n == "triton" else n for n in BACKENDS]

SHAPES = [  # (n queries, T new tokens, end, H, Hkv, hd, page size, nodes)
    (1, 1, 1, 4, 2, 16, 8, 1),        # first token
    (1, 1, 37, 4, 2, 16, 8, 3),       # decode
    (5, 5, 40, 6, 2, 32, 16, 4),      # probe-sized append after a prefix
    (20, 20, 20, 4, 4, 16, 8, 5),     # prefill from empty, MHA
    (3, 24, 64, 8, 1, 16, 4, 6),      # last-rows queries of a chunk (last-layer pruning), MQA
    (70, 70, 150, 9, 3, 64, 64, 7),   # SmolLM2 head shape, more than one key block
    (16, 16, 131, 8, 2, 32, 4, 20),   # 16 queries (the most of cpu's decode kernel), odd length
    (17, 17, 17, 9, 3, 64, 64, 3),    # 17 queries (the fewest of cpu's tiled kernel), from empty
    (40, 48, 200, 6, 2, 64, 1, 200),  # pages of one key, every key its own node, pruned last rows
]


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_brute_force(backend, shape):
    n, T, end, H, Hkv, hd, P, N = shape
    case = make_case(n, T, end, H, Hkv, hd, P, N)
    want_out, want_mass = brute_force(case)
    mass = torch.zeros(n, N)
    out = BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                            case.k_new, case.v_new, case.node_bounds, mass)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.sum(1).double(), torch.full((n,), float(H), dtype=torch.float64),
                               atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("backend", NAMES)
def test_mass_accumulates_and_writes_land_in_the_table_pages(backend):
    case = make_case(4, 4, 30, page_size=8, n_nodes=3)
    pages_before = case.k_pages.clone()
    mass = torch.ones(4, 3)
    BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                      case.k_new, case.v_new, case.node_bounds, mass)
    _, want = brute_force(case)
    torch.testing.assert_close(mass.double(), want + 1, atol=1e-5, rtol=1e-5)
    touched = torch.zeros_like(case.k_pages, dtype=torch.bool)
    for i, s in enumerate(range(26, 30)):
        page = int(case.block_table[s // 8])
        touched[case.layer, page, :, s % 8] = True
        torch.testing.assert_close(case.k_pages[case.layer, page, :, s % 8], case.k_new[i])
    assert torch.equal(case.k_pages[~touched], pages_before[~touched])  # nothing else written


@pytest.mark.parametrize("backend", NAMES)
def test_without_mass_or_writes(backend):
    case = make_case(6, 6, 33, n_nodes=2)
    reference.write_kv(case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new, case.v_new)
    want_out, _ = brute_force(case)
    out = BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)


# Triton's node mass by path: one pass (accumulated next to the output) or two (a second pass with the final lse),
# one key split or several (num_splits=3 gives 3 splits from end > 128, 2 from end > 64: splits are whole key
# blocks). Bounds are explicit where the node layout is the point; an int: that many nodes at random cuts.
MASS_CASES = {  # name: (n queries, T new tokens, end, H, Hkv, hd, page size, node bounds or n_nodes)
    "one node, decode": (1, 1, 140, 4, 2, 16, 8, [0, 140]),
    "node over three key blocks": (9, 9, 200, 4, 2, 16, 16, [0, 5, 170, 200]),
    "nodes on key block bounds (each block's row sum is its node's)": (9, 9, 256, 4, 2, 16, 16, [0, 64, 128, 256]),
    "40 one-key nodes in a key block, MQA decode": (1, 1, 100, 4, 1, 16, 8, [*range(41), 100]),
    "GQA 3, prefill": (5, 5, 130, 6, 2, 32, 4, 7),
    "the last node going on past the keys": (6, 6, 150, 4, 2, 16, 8, [0, 90, 200]),
    "ONE_PASS_MAX_NODES nodes": (3, 3, 150, 6, 2, 16, 8, 128),
    "ONE_PASS_MAX_NODES + 1 nodes": (3, 3, 150, 6, 2, 16, 8, 129),
}


@needs_triton_interpreter
@pytest.mark.parametrize("tiles", [(16, 16, 1, 1), (32, 128, 8, 3), (128, 32, 4, 2)])
@pytest.mark.parametrize("mass_pass", ["one", "two"])
def test_triton_tiles_chosen_by_hand_give_the_same_attention_and_mass(tiles, mass_pass, monkeypatch):
    """`tiles` (what bench triton_gpu --tiles sweeps on a GPU) changes the blocking, not the result: output and
    node mass against brute force, with a prefill whose 14 query rows and 150 keys cut across every tile size; the
    kernel is launched with them; malformed tiles are refused."""
    from nodekv.kernels import triton_attention

    launched = record_attention_tiles(monkeypatch)
    case = _mass_case(7, 7, 150, 4, 2, 16, 8, 5)
    mass = torch.zeros(7, 5)
    out = triton_attention.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table,
                                           case.end, case.k_new, case.v_new, case.node_bounds, mass,
                                           mass_pass=mass_pass, tiles=tiles)
    want_out, want_mass = brute_force(case)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)
    assert launched == [tiles]
    for bad in [(8, 64, 4, 2), (64, 48, 4, 2), (64, 64, 3, 2), (64, 64, 4, 0), (64, 64, 4)]:
        with pytest.raises(ValueError, match="tiles must be"):
            triton_attention.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table,
                                             case.end, tiles=bad)


def _mass_case(n, T, end, H, Hkv, hd, P, nodes):
    if isinstance(nodes, int):
        return make_case(n, T, end, H, Hkv, hd, P, nodes)
    return replace(make_case(n, T, end, H, Hkv, hd, P), node_bounds=torch.tensor(nodes, dtype=torch.int32))


@needs_triton_interpreter
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mass_pass", ["one", "two"])
@pytest.mark.parametrize("name", MASS_CASES)
def test_triton_node_mass_one_and_two_pass(name, mass_pass, splits):
    from nodekv.kernels import triton_attention

    case = _mass_case(*MASS_CASES[name])
    n, H = case.q.shape[:2]
    N = case.node_bounds.shape[0] - 1
    mass = torch.ones(n, N)  # mass is added to
    run = lambda: triton_attention.paged_attention(  # noqa: E731
        case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new, case.v_new,
        case.node_bounds, mass, num_splits=splits, mass_pass=mass_pass)
    if mass_pass == "one" and N > triton_attention.ONE_PASS_MAX_NODES:
        with pytest.raises(ValueError, match="at most"):
            run()
        return
    out = run()
    want_out, want_mass = brute_force(case)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double() - 1, want_mass, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.sum(1).double() - N, torch.full((n,), float(H), dtype=torch.float64),
                               atol=1e-5, rtol=1e-6)


@needs_triton_interpreter
@pytest.mark.parametrize("mass_pass", ["one", "two"])
@pytest.mark.parametrize("bounds", [[0, 30, 2**31], [0, 30, 2**32 + 3, 2**40]])
def test_triton_int64_bounds_far_past_the_keys(mass_pass, bounds):
    """int64 bounds may end far past the keys (a last node that goes on). Cast to int32 as they were, 2**31 wrapped
    to a negative node start: the one pass lost the last node's mass, the two-pass wrote outside mass's rows."""
    from nodekv.kernels import triton_attention

    case = replace(make_case(5, 5, 40), node_bounds=torch.tensor(bounds))
    mass = torch.zeros(5, len(bounds) - 1)
    out = triton_attention.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table,
                                           case.end, case.k_new, case.v_new, case.node_bounds, mass,
                                           mass_pass=mass_pass)
    want_out, want_mass = brute_force(case)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bounds", [[0, 30, 2**40], [0, 30, 2**40 + 3, 2**41]])
def test_reference_bounds_far_past_the_keys(bounds):
    """The reference finds each key's node by search: built by repeating each node's length, it allocated b[N] node
    ids (8 TiB for a last bound of 2**40)."""
    case = replace(make_case(5, 5, 40), node_bounds=torch.tensor(bounds))
    mass = torch.zeros(5, len(bounds) - 1)
    out = reference.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                                    case.k_new, case.v_new, case.node_bounds, mass)
    want_out, want_mass = brute_force(case)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)


# prefills from an empty cache (T = end) through SDPA with the mass pass after it: every query, or the last one only
SDPA_CASES = {  # name: (n queries, T = end keys, H, Hkv, hd, page size, node bounds or n_nodes)
    "nodes on key block bounds": (256, 256, 4, 2, 16, 16, [0, 64, 128, 256]),
    "GQA 3, random nodes": (130, 130, 6, 2, 32, 4, 7),
    "40 one-key nodes in a key block, MQA": (100, 100, 4, 1, 16, 8, [*range(41), 100]),
    "the last node going on past the keys": (150, 150, 4, 2, 16, 8, [0, 90, 200]),
    "the last query only": (1, 150, 4, 2, 16, 8, [0, 5, 90, 150]),
}


@needs_triton_interpreter
@pytest.mark.parametrize("name", SDPA_CASES)
def test_triton_sdpa_prefill_and_its_mass_pass(name):
    """`sdpa_prefill`: torch's SDPA for the output and its log-sum-exp for `_attn_mass`'s node mass (added to what
    mass held), both against the float64 oracle; the keys and values land in the table's pages."""
    from nodekv.kernels import triton_attention

    n, T, H, Hkv, hd, P, nodes = SDPA_CASES[name]
    case = _mass_case(n, T, T, H, Hkv, hd, P, nodes)
    want_out, want_mass = brute_force(case)
    want_k, want_v = case.k_pages.clone(), case.v_pages.clone()
    reference.write_kv(want_k, want_v, case.layer, case.block_table, T, case.k_new, case.v_new)
    N = case.node_bounds.shape[0] - 1
    mass = torch.ones(n, N)
    out = triton_attention.sdpa_prefill(case.q, case.k_pages, case.v_pages, case.layer, case.block_table,
                                        case.k_new, case.v_new, case.node_bounds, mass)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double() - 1, want_mass, atol=1e-5, rtol=1e-5)
    assert torch.equal(case.k_pages, want_k) and torch.equal(case.v_pages, want_v)
    without = triton_attention.sdpa_prefill(case.q, want_k.clone(), want_v.clone(), case.layer, case.block_table,
                                            case.k_new, case.v_new)
    torch.testing.assert_close(without.double(), want_out, atol=1e-5, rtol=1e-5)


@needs_triton_interpreter
def test_triton_sdpa_prefill_refuses_before_writing():
    """Queries that are neither every position nor the last, mass without bounds or of the wrong shape, and bounds
    that leave keys out: one line each, and the pages untouched."""
    from nodekv.kernels import triton_attention

    case = make_case(20, 20, 20, 4, 2, 16, 8, 3)
    pages = case.k_pages.clone()
    bad = {"every position": (case.q[:5], case.node_bounds, torch.zeros(5, 3)),
           "needs node_bounds": (case.q, None, torch.zeros(20, 3)),
           "float32 \\[20, 3\\]": (case.q, case.node_bounds, torch.zeros(20, 4)),
           "node_bounds": (case.q, torch.tensor([0, 5, 19], dtype=torch.int32), torch.zeros(20, 2))}
    for match, (q, bounds, mass) in bad.items():
        with pytest.raises(ValueError, match=match):
            triton_attention.sdpa_prefill(q, case.k_pages, case.v_pages, case.layer, case.block_table, case.k_new,
                                          case.v_new, bounds, mass)
    assert torch.equal(case.k_pages, pages)


class _Unreachable:
    def __getitem__(self, grid):
        raise AssertionError("the two-pass mass kernel was launched")


@needs_triton_interpreter
@pytest.mark.parametrize("extra", [0, 1])
def test_triton_mass_pass_defaults_to_one_up_to_the_limit(monkeypatch, extra):
    from nodekv.kernels import triton_attention

    N = triton_attention.ONE_PASS_MAX_NODES + extra
    case = make_case(1, 1, N + 5, n_nodes=N)
    monkeypatch.setattr(triton_attention, "_attn_mass", _Unreachable())
    args = (case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new, case.v_new,
            case.node_bounds, torch.zeros(1, N))
    if extra:
        with pytest.raises(AssertionError, match="two-pass"):
            triton_attention.paged_attention(*args)
    else:
        triton_attention.paged_attention(*args)
    with pytest.raises(ValueError, match="mass_pass must be"):
        triton_attention.paged_attention(*args, mass_pass="three")


@needs_triton_interpreter
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("ends, H, Hkv, page", [([1, 37, 200, 64], 4, 2, 8), ([150, 9], 8, 1, 16),
                                                  ([130, 129, 131], 6, 6, 4)])
def test_triton_decode_attention_equals_each_sequence_alone(ends, H, Hkv, page, splits):
    """A batch's decode step in one launch (`decode_attention`): each sequence's own pages, length and new key and
    value in one shared pool, against the float64 oracle of that sequence alone; pages outside the new rows are
    untouched."""
    from nodekv.kernels import reference, triton_attention

    cases, k_pages, v_pages, tables = make_batch(ends, H, Hkv, 32, page)
    want_k, want_v = k_pages.clone(), v_pages.clone()
    for b, c in enumerate(cases):
        reference.write_kv(want_k, want_v, c.layer, tables[b], c.end, c.k_new, c.v_new)
    out = triton_attention.decode_attention(
        torch.cat([c.q for c in cases]), k_pages, v_pages, cases[0].layer, tables,
        torch.tensor(ends, dtype=torch.int32), max(ends), torch.cat([c.k_new for c in cases]),
        torch.cat([c.v_new for c in cases]), num_splits=splits)
    want = torch.cat([brute_force(c)[0] for c in cases])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("bounds", [
    [5, 60, 150],       # keys before the first node would be in none
    [0, 90, 90, 150],   # an empty node
    [0, 100, 60, 150],
    [0, 60, 149],       # the last key in no node
    [0],
])
def test_node_bounds_that_do_not_cover_the_keys_are_refused(backend, bounds):
    """Bounds that leave keys out of every node (or out of order) are refused with a line naming node_bounds before
    any work, by every backend, rather than summing mass that silently misses keys."""
    case = make_case(3, 3, 150, 4, 2, 16, 8, 2)
    bounds = torch.tensor(bounds, dtype=torch.int32)
    pages = case.k_pages.clone()
    with pytest.raises(ValueError, match="node_bounds"):
        BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new,
                          case.v_new, bounds, torch.zeros(3, max(1, bounds.shape[0] - 1)))
    assert torch.equal(case.k_pages, pages)  # refused before the new keys were written


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("bad_page", [-1, 10_000])
def test_page_ids_outside_the_pool_are_refused(backend, bad_page):
    """A block-table entry that is not a page of the pool is refused with a line naming it before any work, by every
    backend: a negative id would otherwise index from the pool's end (torch) or read outside it (Triton)."""
    case = make_case(3, 3, 150, 4, 2, 16, 8, 2)
    table = case.block_table.clone()
    table[5] = bad_page
    pages = case.k_pages.clone()
    with pytest.raises(ValueError, match=rf"block_table\[5\] = {bad_page} is not a page of the pool's"):
        BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, table, case.end, case.k_new, case.v_new,
                          case.node_bounds, torch.zeros(3, 2))
    assert torch.equal(case.k_pages, pages)


@needs_triton_interpreter
def test_triton_decode_attention_refuses_a_page_outside_the_pool():
    """A row's entries up to its own end must be pages of the pool (the -1 padding past it is never read)."""
    from nodekv.kernels import triton_attention

    ends = [37, 9]
    cases, k_pages, v_pages, tables = make_batch(ends, 4, 2, 32, 8)
    tables[1, 1] = k_pages.shape[1]
    pages = k_pages.clone()
    with pytest.raises(ValueError, match=r"decode_attention: block_table\[1\] = \d+ is not a page of the pool's"):
        triton_attention.decode_attention(
            torch.cat([c.q for c in cases]), k_pages, v_pages, cases[0].layer, tables,
            torch.tensor(ends, dtype=torch.int32), max(ends), torch.cat([c.k_new for c in cases]),
            torch.cat([c.v_new for c in cases]))
    assert torch.equal(k_pages, pages)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("dim", [2, 3, 4])
def test_pages_with_an_empty_head_page_or_head_dim_are_refused(backend, dim):
    """Pages with no KV heads, no rows per page or head_dim 0 are refused with a line, not divided by: the C++
    kernel died of SIGFPE on page_size or head_dim 0, Triton's wrapper and the reference raised ZeroDivisionError."""
    shape = [1, 2, 2, 8, 16]  # [layers, n_pages, kv_heads, page_size, head_dim]
    shape[dim] = 0
    q = torch.zeros(0, 4, shape[4])  # no queries over no keys: nothing to compute, yet nothing to divide by
    with pytest.raises(ValueError, match="kv_heads, page_size and head_dim >= 1"):
        BACKENDS[backend](q, torch.zeros(shape), torch.zeros(shape), 0, torch.zeros(1, dtype=torch.int32), 0)


@needs_triton_interpreter
def test_triton_paged_attention_refuses_bad_arguments_before_writing():
    """A k_new without v_new (or the reverse), integer queries and a mass output whose rows share memory (an
    expanded view) get one ValueError naming the argument, the pages and mass untouched: they raised
    AttributeError, an interpreter error, dropped v_new silently, or summed every row's mass into one."""
    from nodekv.kernels import triton_attention

    case = make_case(3, 3, 40, 4, 2, 16, 8, 2)
    pages = case.k_pages.clone()
    mass = torch.zeros(1, 2).expand(3, 2)
    bad = [("give both k_new and v_new", case.q, case.k_new, None, None),
           ("give both k_new and v_new", case.q, None, case.v_new, None),
           ("q must be a floating-point tensor, got torch.int32", case.q.int(), case.k_new, case.v_new, None),
           ("mass is added to in place", case.q, case.k_new, case.v_new, mass)]
    for match, q, k_new, v_new, m in bad:
        with pytest.raises(ValueError, match=match):
            triton_attention.paged_attention(q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                                             k_new, v_new, case.node_bounds, m)
    assert torch.equal(case.k_pages, pages) and not mass.any()


# the KV writes besides paged_attention's: each backend's write_kv, and Triton's batched decode step
KV_WRITERS = ["reference.write_kv", pytest.param("triton.write_kv", marks=needs_triton_interpreter),
              pytest.param("triton.decode_attention", marks=needs_triton_interpreter)]


@pytest.mark.parametrize("backend", NAMES + KV_WRITERS)
@pytest.mark.parametrize("which", ["k_pages", "v_pages"])
def test_a_kv_write_into_an_expanded_pool_is_refused(backend, which):
    """Pages that share memory (an expanded view) are refused with one line by every backend's KV write, before
    anything is written: the reference wrote through them with only torch's deprecation warning, Triton silently
    (every page then held the last key written to its row), and the C++ path said "must be contiguous"."""
    from nodekv.kernels import triton_attention

    case = make_case(3, 3, 40, 4, 2, 16, 8, 2)
    pages = {"k_pages": case.k_pages, "v_pages": case.v_pages}
    shared = pages[which][:, :1].clone()
    before = shared.clone()
    pages[which] = shared.expand_as(pages[which])
    k_pages, v_pages = pages["k_pages"], pages["v_pages"]
    with pytest.raises(ValueError, match=rf"{which} is written in place, so no two of its elements may share memory"):
        if backend == "triton.decode_attention":
            triton_attention.decode_attention(case.q[-1:], k_pages, v_pages, case.layer, case.block_table[None],
                                              torch.tensor([case.end], dtype=torch.int32), case.end,
                                              case.k_new[-1:], case.v_new[-1:])
        elif backend.endswith("write_kv"):
            module = reference if backend == "reference.write_kv" else triton_attention
            module.write_kv(k_pages, v_pages, case.layer, case.block_table, case.end, case.k_new, case.v_new)
        else:
            BACKENDS[backend](case.q, k_pages, v_pages, case.layer, case.block_table, case.end, case.k_new,
                              case.v_new)
    assert torch.equal(shared, before)


@pytest.mark.parametrize("writer", ["reference", pytest.param("triton", marks=needs_triton_interpreter)])
@pytest.mark.parametrize("rows", [None, 1, 0])
def test_write_kv_needs_v_of_k_shape(writer, rows):
    """write_kv without v, or with a v of other rows, is one ValueError in both backends that have it, nothing
    written: v=None raised AttributeError in both, and the reference broadcast a v of one row into every row."""
    from nodekv.kernels import triton_attention

    case = make_case(3, 3, 40, 4, 2, 16, 8, 2)
    v = None if rows is None else case.v_new[:rows]
    pages = case.k_pages.clone(), case.v_pages.clone()
    module = reference if writer == "reference" else triton_attention
    with pytest.raises(ValueError, match=r"write_kv: v must be a tensor of k's shape \(3, 2, 16\), got "):
        module.write_kv(case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new, v)
    assert torch.equal(case.k_pages, pages[0]) and torch.equal(case.v_pages, pages[1])


@pytest.mark.parametrize("backend", NAMES)
def test_a_lone_k_new_or_v_new_is_refused(backend):
    """Every backend refuses k_new without v_new, and the reverse, with one line and nothing written: the reference
    raised AttributeError on the first and dropped v_new silently on the second."""
    case = make_case(3, 3, 40, 4, 2, 16, 8, 2)
    pages = case.k_pages.clone(), case.v_pages.clone()
    for k_new, v_new in ((case.k_new, None), (None, case.v_new)):
        with pytest.raises(ValueError, match="give both k_new and v_new or neither"):
            BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, k_new,
                              v_new)
    assert torch.equal(case.k_pages, pages[0]) and torch.equal(case.v_pages, pages[1])


@pytest.mark.parametrize("backend", NAMES)
def test_a_v_new_of_other_rows_is_refused_in_the_callers_name(backend):
    """paged_attention with a v_new of other rows than k_new's is one ValueError naming paged_attention, nothing
    written: the reference and Triton backends named write_kv, the helper they store through."""
    case = make_case(3, 3, 40, 4, 2, 16, 8, 2)
    pages = case.k_pages.clone(), case.v_pages.clone()
    with pytest.raises(ValueError, match=r"^paged_attention: v(_new)? "):
        BACKENDS[backend](case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new,
                          case.v_new[:1])
    assert torch.equal(case.k_pages, pages[0]) and torch.equal(case.v_pages, pages[1])
