"""DICE's prompts (dice.txt App. D): the five decomposition examples (three chains, two DAGs) written in each
algorithm's format, two variable-tracking chains in the same shape (the paper does not show its §4.2 prompts), and the
fact-extraction prompt P_e verbatim (the re-ranker's question is `relevance.QUESTION`).

App. D names the five example questions and shows one of them worked in each format (Fig. 4); the other four are
worked here the same way. Alg. 1's example keeps the lines Algorithm 1 writes into T (sub-question, fact, final
answer); Fig. 4a's "Generated answer / contradicts" lines belong to MQuAKE's knowledge-editing setting, where the
model's belief can disagree with an edit, and Algorithm 1 has no such step. Alg. 2's thoughts are written one per
line, each ending "#" as in Fig. 4b, so that "another thought or the answer" is a constrained choice between two
line labels instead of a string match on free text.
"""
from __future__ import annotations

# (question, [(sub-question, fact / thought), ...], answer)
EXAMPLES: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("What is the birth day of Rainn Wilson's father?",
     (("Who is the father of Rainn Wilson?", "The father of Rainn Wilson is Robert G. Wilson."),
      ("When was Robert G. Wilson born?", "Robert G. Wilson was born on 15 September 1933.")),
     "15 September 1933"),
    ("Who is the paternal grandfather of John Smith?",
     (("Who is the father of John Smith?", "The father of John Smith is William Smith."),
      ("Who is the father of William Smith?", "The father of William Smith is Thomas Smith.")),
     "Thomas Smith"),
    ("What is the capital city of the country of citizenship of Ivanka Trump's spouse?",
     (("Who is Ivanka Trump's spouse?", "The spouse of Ivanka Trump is Jared Kushner."),
      ("What is the country of citizenship of Jared Kushner?", "Jared Kushner holds the citizenship of Canada."),
      ("What is the capital city of Canada?", "The capital of Canada is Ottawa.")),
     "Ottawa"),
    ("Do both Django Unchained and Rango films have the directors from the same country?",
     (("Who is the director of Django Unchained?", "Django Unchained was directed by Quentin Tarantino."),
      ("Who is the director of Rango?", "Rango was directed by Gore Verbinski."),
      ("What is the country of Quentin Tarantino?", "Quentin Tarantino is from the United States."),
      ("What is the country of Gore Verbinski?", "Gore Verbinski is from the United States.")),
     "yes"),
    ("Which film has the director who died first, Love in the Afternoon or Gigi?",
     (("Who is the director of Love in the Afternoon?", "Love in the Afternoon was directed by Billy Wilder."),
      ("Who is the director of Gigi?", "Gigi was directed by Vincente Minnelli."),
      ("When did Billy Wilder die?", "Billy Wilder died on March 27, 2002."),
      ("When did Vincente Minnelli die?", "Vincente Minnelli died on July 25, 1986.")),
     "Gigi"),
)

# Variable tracking (§4.2): follow the chain one assignment at a time until no variable takes the last one's value.
VARIABLE_EXAMPLES: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("Find all variables that are assigned the value 52817.",
     (("Which variable is assigned the value 52817?", "VAR QWERT = 52817."),
      ("Which variable is assigned the value of VAR QWERT?", "VAR ZXCVB = VAR QWERT."),
      ("Which variable is assigned the value of VAR ZXCVB?", "No variable is assigned the value of VAR ZXCVB.")),
     "QWERT ZXCVB"),
    ("Find all variables that are assigned the value 30946.",
     (("Which variable is assigned the value 30946?", "VAR MNBVC = 30946."),
      ("Which variable is assigned the value of VAR MNBVC?", "VAR POIUY = VAR MNBVC."),
      ("Which variable is assigned the value of VAR POIUY?", "VAR LKJHG = VAR POIUY."),
      ("Which variable is assigned the value of VAR LKJHG?", "No variable is assigned the value of VAR LKJHG.")),
     "MNBVC POIUY LKJHG"),
)
EXAMPLE_SETS = {"multihop": EXAMPLES, "variables": VARIABLE_EXAMPLES}

# Algorithm 1 (iterative QA with fact extraction): T is the question, then sub-question / fact pairs.
SUBQUESTION, FACT, FINAL_ANSWER = "Subquestion:", "Fact:", "Final answer:"
PLAN_INSTRUCTION = ("Answer a complex question step by step. Ask one simple subquestion at a time; after each, a fact "
                    "that answers it is given. When the facts are enough, give the final answer in as few words as "
                    "possible. Follow the format of these examples.")

# Algorithm 2 (knowledge-constrained decoding): T is the question, then thoughts with new knowledge.
THOUGHTS, THOUGHT, STEP_END, ANSWER = "Thoughts with New Knowledge:", "Thought:", "#", "Answer:"
THOUGHT_INSTRUCTION = ("Answer a complex question by reasoning in short thoughts, one fact per thought, each ending "
                       "with \"#\". A thought may be preceded by a reference passage: the thought must then agree "
                       "with the reference. When the thoughts are enough, give the answer in as few words as "
                       "possible. Follow the format of these examples.")
REFERENCE = "Reference: {}\n"

# P_e, App. D verbatim (one user turn; the model's reply is the fact).
EXTRACT_FACT = ("Reference: {}. Based on the reference, present the fact to answer the following question.\n"
                "Be concise, better one sentence.\nQuestion: {}. Fact:")

def alg1_example(question: str, steps: tuple[tuple[str, str], ...], answer: str) -> str:
    lines = [f"Question: {question}"]
    for sub, fact in steps:
        lines += [f"{SUBQUESTION} {sub}", f"{FACT} {fact}"]
    return "\n".join(lines + [f"{FINAL_ANSWER} {answer}"])


def alg2_example(question: str, steps: tuple[tuple[str, str], ...], answer: str) -> str:
    lines = [f"Question: {question}", THOUGHTS] + [f"{THOUGHT} {fact}{STEP_END}" for _, fact in steps]
    return "\n".join(lines + [f"{ANSWER} {answer}"])


def planning_turn(algorithm: int, examples: str = "multihop") -> str:
    """The user turn of either algorithm with an `EXAMPLE_SETS` entry, "{}" where the question goes."""
    instruction, example = (PLAN_INSTRUCTION, alg1_example) if algorithm == 1 else (THOUGHT_INSTRUCTION, alg2_example)
    shots = "\n\n".join(example(*e) for e in EXAMPLE_SETS[examples])
    return f"{instruction}\n\n{shots}\n\nQuestion: {{}}"
