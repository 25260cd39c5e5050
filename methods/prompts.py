"""Prompts and answer lengths per dataset: LongBench's templates and generation budgets where LongBench has the
dataset (hotpotqa, 2wikimqa, musique, narrativeqa, multi_news, qmsum, and its qasper template for scientific_qa),
plain equivalents for the L-Eval files, and a letter-answer prompt for QuALITY's multiple choice."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.sampling import SamplingParams

_MULTIHOP = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
             "passages. Only give me the answer and do not output any other words.\n\nQuestion: {question}\nAnswer:")
_NARRATIVE = ("You are given a story, which can be either a novel or a movie script, and a question. Answer the "
              "question as concisely as you can, using a single phrase if possible. Do not provide any explanation."
              "\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a "
              "single phrase if possible. Do not provide any explanation.\n\nQuestion: {question}\n\nAnswer:")
_QASPER = ("You are given a scientific article and a question. Answer the question as concisely as you can, using a "
           "single phrase or sentence if possible. If the question cannot be answered based on the information in "
           "the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
           "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on "
           "the above article as concisely as you can, using a single phrase or sentence if possible. If the "
           "question cannot be answered based on the information in the article, write \"unanswerable\". If the "
           "question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
           "explanation.\n\nQuestion: {question}\n\nAnswer:")
_DOC_QA = ("Answer the question based on the given document. Only give me the answer and do not output any other "
           "words.\n\nDocument:\n{context}\n\nAnswer the question based on the given document. Only give me the "
           "answer and do not output any other words.\n\nQuestion: {question}\nAnswer:")
_MULTI_NEWS = ("You are given several news articles. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
               "Now, write a one-page summary of all the news.\n\nSummary:")
_QMSUM = ("You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
          "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
          "transcript in one or more sentences.\n\nQuery: {question}\nAnswer:")
_SUMMARY = ("You are given a long document and an instruction about it.\n\nDocument:\n{context}\n\nNow, follow the "
            "instruction based on the above document.\n\nInstruction: {question}\nAnswer:")
_VARIABLES = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n\n"
              "Question: {question}\nAnswer:")  # RULER's variable tracking
_CHOICE = ("Read the document and answer the multiple-choice question with the letter of the correct option only."
           "\n\nDocument:\n{context}\n\nAnswer the multiple-choice question with the letter of the correct option "
           "only.\n\nQuestion: {question}\n{options}\nAnswer:")


@dataclass(frozen=True)
class PromptSpec:
    """A prompt template with {context}, {question} and ({options}), the answer's token budget, its stop strings and
    the repetition penalty its decoding applies (`Session.generate`)."""

    template: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0

    @property
    def sampling(self) -> SamplingParams:
        """The answer's decoding: greedy within the budget, the stops, the repetition penalty over the generated
        tokens only (a penalty over the prompt pushes a summary away from the document's own words)."""
        return SamplingParams(self.max_new_tokens, self.stop, repetition_penalty=self.repetition_penalty,
                              penalize_prompt=False)

    def render(self, context: str, question: str, options: tuple[str, ...] = ()) -> str:
        letters = "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
        return self.template.format(context=context, question=question, options=letters)

    def instruction(self, question: str, options: tuple[str, ...] = ()) -> str:
        """The template's part after the context (LongBench's closing instruction and the question), for a turn
        that follows a context already in the conversation."""
        return replace(self, template=self.template.split("{context}", 1)[-1].lstrip()).render("", question, options)


# Greedy 512-token summaries from qwen2.5-0.5b fall into loops ("nnn nnn ...") on some meetings, which every method
# then pays for in ROUGE; HF's repetition penalty of 1.1 ended the loop among BM25's first five QMSum summaries and
# moved their ROUGE-L from 20.3 to 20.9. QA answers are short and keep plain greedy decoding.
SUMMARY_PENALTY = 1.1

PROMPTS: dict[str, PromptSpec] = {
    "hotpotqa": PromptSpec(_MULTIHOP, 32, ("\n",)),
    "2wikimqa": PromptSpec(_MULTIHOP, 32, ("\n",)),
    "musique": PromptSpec(_MULTIHOP, 32, ("\n",)),
    "narrativeqa": PromptSpec(_NARRATIVE, 128),
    "scientific_qa": PromptSpec(_QASPER, 128),
    "multidoc_qa": PromptSpec(_DOC_QA, 128),
    "natural_question": PromptSpec(_DOC_QA, 64),
    "quality": PromptSpec(_CHOICE, 16, ("\n",)),
    "multi_news": PromptSpec(_MULTI_NEWS, 512, repetition_penalty=SUMMARY_PENALTY),
    "qmsum": PromptSpec(_QMSUM, 512, repetition_penalty=SUMMARY_PENALTY),
    "qmsum_general": PromptSpec(_QMSUM, 512, repetition_penalty=SUMMARY_PENALTY),
    "gov_report_summ": PromptSpec(_SUMMARY, 512, repetition_penalty=SUMMARY_PENALTY),
    "meeting_summ": PromptSpec(_SUMMARY, 512, repetition_penalty=SUMMARY_PENALTY),
    "news_summ": PromptSpec(_SUMMARY, 512, repetition_penalty=SUMMARY_PENALTY),
    "tv_show_summ": PromptSpec(_SUMMARY, 512, repetition_penalty=SUMMARY_PENALTY),
    "variable_tracking": PromptSpec(_VARIABLES, 64),  # the names may come one per line
}


def prompt_for(dataset: str, max_new_tokens: int | None = None) -> PromptSpec:
    """The dataset's prompt (RULER's for every variable-tracking configuration, `variable_tracking_<shape>`); unknown
    names get the generic document-QA prompt. `max_new_tokens` replaces its answer budget (None keeps the prompt's)."""
    if dataset.startswith("variable_tracking_"):
        dataset = "variable_tracking"
    prompt = PROMPTS.get(dataset, PromptSpec(_DOC_QA, 64))
    return prompt if max_new_tokens is None else replace(prompt, max_new_tokens=max_new_tokens)
