"""The prompt side: a row of the data (``prompt_row``), datasets of rows from files (``dataset_prompts``), and
how a row becomes the prompt text (``prompt_format``: raw, or through the tokenizer's chat template)."""
