"""`selfrag eval`: QA systems run over a question set against an indexed corpus, and their
report (the runner in `eval_runner`)."""
