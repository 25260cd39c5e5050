"""JERR's prompts: App. A.1-A.6 verbatim where the paper gives them ("{}" where its placeholders go), and the two it
names without showing: the question's keywords (§3.4) and the look-up of chunks to re-read (§3.4, after ReadAgent)."""
from __future__ import annotations

SYNOPSIS = ("Please transfer the following chunk of a passage into synopsis.\n"
            "Just give me a synopsis version. No extra explanation.\nPassage: {}")
ATOMS = ("You are a summarizing agent. Given a chunk of paragraph, summarize it into information atoms. (Information "
         "Atoms: Brief statements represent the most fundamental, indivisible facts, covering ideas like "
         "propositions, theories, entities, concepts, and underlying aspects such as reasoning, cause-effect "
         "relationships, event sequences, social interactions, timelines, and similar elements.)\n\nParagraph: {}")
ELEMENTS = ("You are a keyword extracting agent. Given a chunk of paragraph of a story, extract only 3 core "
            "components.\n(Core components: The fundamental nouns (e.g., people, moments, occurrences, settings, "
            "quantities), verbs (e.g., activities), and adjectives (e.g., conditions, emotions) that are central to the "
            "story's progression.)\n\nParagraph: {}")
EDGE = ("Based on the atomic facts: '{}' and '{}', what are the attributes between {} and {}?\n"
        "(Information Atoms: smallest, indivisible truths extracted from text chunks.)\n"
        "Use no more than three words to answer.")
QUALITY_ANSWER = ("Read the following article and answer a multiple choice question. For example, if (C) is correct, "
                  "answer with \"Answer: (C) ...\". No extra explanation please.\nArticle: {}\nQuestion: {} {}")
OPEN_ANSWER = ("{}\nQuestion: {}\nAnswer the question based on the above relevant content and extracted synopsis. "
               "Your answer should be short and concise.")
# not shown in the paper
KEYWORDS = ("List the keywords of the following question: the names, things and actions it is about, "
            "comma-separated, nothing else.\nQuestion: {}")
LOOKUP = ("The following are numbered synopses of pages of a text, then a question. Which pages should be read again "
          "in full to answer the question? Answer with the page numbers, comma-separated, or \"none\".\n\n{}\n\n"
          "Question: {}")
