"""PECAN's graph arithmetic against values computed by hand: edge normalisation, Eq. (1) scores, App. C's
positional relevance, the visit order on a toy graph, and IP parsing of messy model output."""
import pytest
import torch

from nodekv.methods.pecan.pecan_graph import Graph, edge_weights, next_node, parse_ips, positional_relevance, scores


def toy() -> Graph:
    g = Graph()
    for level, text in [(2, "ip a"), (2, "ip b"), (1, "c0"), (1, "c1"), (1, "c2")]:
        g.add(level, text)
    g.edges = {0: {2: 0.7, 3: 0.3}, 1: {3: 0.5, 4: 0.5}}
    return g


def test_edge_weights_rows_sum_to_one_and_stay_zero_without_attention():
    w = edge_weights(torch.tensor([[0.2, 0.6, 0.2], [0.0, 0.0, 0.0], [1.0, 3.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.6, 0.2], [0.0, 0.0, 0.0], [0.25, 0.75, 0.0]]))


def test_scores_and_visit_order_by_hand():
    g = toy()
    r = {0: 0.2, 1: 0.4}
    z = scores(g, [0, 1], r)
    assert z == pytest.approx({2: 0.14, 3: 0.06 + 0.2, 4: 0.2})
    sim = {2: 0.1, 3: 0.0, 4: 0.3}
    order, visited = [], [0, 1]
    for _ in range(3):
        picked = next_node(g, visited, r, sim)
        order.append((picked.node, round(picked.z + picked.similarity, 6)))
        visited.append(picked.node)
        r[picked.node] = 0.05
    assert order == [(4, 0.5), (3, 0.26), (2, 0.24)]  # z + similarity
    by_z = next_node(g, [0, 1], {0: 0.2, 1: 0.4}, sim, embedding=False)
    assert (by_z.node, by_z.z, by_z.similarity, by_z.by_similarity) == (3, pytest.approx(0.26), 0.0, 4)
    assert next_node(g, [0, 1], {0: 0.2, 1: 0.4}, sim, attention=False).node == 4
    assert next_node(g, [0, 1, 2, 3, 4], r, sim) is None
    assert g.top_level == [0, 1] and g.parents(3) == {0: 0.3, 1: 0.5}


def test_every_unvisited_node_is_a_candidate_as_in_the_paper():
    g = toy()
    g.add(1, "c3: points to nothing visited")  # node 5, no edge from ip a or ip b
    r, sim = {0: 0.2, 1: 0.4}, {2: 0.1, 3: 0.0, 4: 0.3, 5: 0.9}
    paper = next_node(g, [0, 1], r, sim)
    assert (paper.node, paper.z, paper.similarity) == (5, 0.0, 0.9)  # reached by similarity alone (§3.2.2)
    assert next_node(g, [0, 1], r, sim, successors_only=True).node == 4  # 0.2 + 0.3 among the children
    assert next_node(g, [0, 1, 2, 3, 4], r, sim, successors_only=True).node == 5  # no child left: all unvisited


def test_positional_relevance():
    assert positional_relevance([0.1, 0.1, 0.05]) == pytest.approx([0.2, 0.3, 0.2])


@pytest.mark.parametrize("text, ips, how", [
    ("- The king dies.\n- His son flees the city.", ["The king dies.", "His son flees the city."], "bullets"),
    ("1. Anna meets Bob.\n2) Bob lies to Anna.\n\n3. Anna meets Bob.", ["Anna meets Bob.", "Bob lies to Anna."],
     "bullets"),
    ("Here are the points:\n* Ships sink at dawn.\n• Crew survives.", ["Ships sink at dawn.", "Crew survives."],
     "bullets"),
    ("The war ended in 1918.\nPeace talks began later.", ["The war ended in 1918.", "Peace talks began later."],
     "lines"),
    ("The war ended in 1918. Peace talks began later.", ["The war ended in 1918.", "Peace talks began later."],
     "sentences"),
    ("", [], "empty"),
    ("- ok\n- no", [], "empty"),
    ("* summary point\n* The keeper lit the lamp.\n* Summary point", ["The keeper lit the lamp."], "bullets"),
    ("* 1. The town lies on a river.\n2. Wheat grows north of it.", ["The town lies on a river.",
                                                                  "Wheat grows north of it."], "bullets"),
])
def test_parse_ips(text, ips, how):
    assert parse_ips(text)[:2] == (ips, how)


def test_parse_ips_counts_repeats_it_drops():
    assert parse_ips("* Ships sink.\n* ships   SINK.\n* Crew lives on.\n* ok") == (
        ["Ships sink.", "Crew lives on."], "bullets", 2)


def test_a_looping_point_is_dropped():
    loop = "The first summary point is: " * 20
    song = "Row, row, row your boat, gently down the stream; merrily, merrily, merrily, merrily, life is but a dream."
    assert parse_ips(f"1. {loop}\n2. The team's colors are black and white.\n3. {song}") == (
        ["The team's colors are black and white.", song], "bullets", 1)
    assert parse_ips(loop.strip()) == ([], "empty", 1)  # one looping sentence-less line: nothing left


def test_bad_pecan_options_are_refused_by_name():
    from nodekv.methods.pecan.pecan import Pecan

    for options, message in [({"tp": 0.4}, "unknown PECAN option"), ({"t_p": 1.5}, "t_p must be in"),
                             ({"attention": "no"}, "attention must be bool"), ({"t_n": 0}, "t_n must be >= 1"),
                             ({"node_budget": 2.5}, "node_budget must be int")]:
        with pytest.raises(ValueError, match=message):
            Pecan(None, **options)


def test_max_scaled_z_weighs_like_similarity():
    """Eq. (1)'s z is tiny beside cosine similarity; z_scale="max" divides it by the candidates' largest z."""
    g = toy()
    r, sim = {0: 0.002, 1: 0.004}, {2: 0.30, 3: 0.10, 4: 0.31}
    # z = {2: 0.0014, 3: 0.0006 + 0.002 = 0.0026, 4: 0.002}: the paper's sum follows similarity (4, then 2)
    assert next_node(g, [0, 1], r, sim).node == 4
    scaled = next_node(g, [0, 1], r, sim, z_scale="max")  # 2: 0.538 + 0.30, 3: 1 + 0.10, 4: 0.769 + 0.31
    assert (scaled.node, scaled.z, scaled.by_similarity) == (3, pytest.approx(0.0026), 4)
    assert next_node(g, [0, 1], {}, sim, z_scale="max").node == 4  # no attention yet: similarity decides
    with pytest.raises(ValueError, match="z_scale"):
        next_node(g, [0, 1], r, sim, z_scale="softmax")


def test_the_paper_thresholds_are_keyed_by_dataset_names_eval_knows():
    """App. E's t_p per dataset reaches `nodekv eval` only under a name it loads (Qasper is scientific_qa here)."""
    from nodekv.evaluation.datasets import DATASETS
    from nodekv.methods.pecan.pecan import PAPER_T_P, Pecan

    assert set(PAPER_T_P) <= set(DATASETS)
    assert Pecan.dataset_defaults("scientific_qa")["t_p"][0] == 0.98
