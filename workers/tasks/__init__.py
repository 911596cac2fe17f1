"""What is trained: the `Task` contract, the default byte-level GPT on the embedded corpus,
the Hugging Face task, the digits example, and their data pipelines."""
