"""Long-document QA methods (PECAN, DICE, GoR, JERR) and baselines, as policies on the engine."""
