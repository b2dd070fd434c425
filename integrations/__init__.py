"""Framework adapters: LangChain (`selfrag[langchain]`) and LlamaIndex (`selfrag[llamaindex]`)."""
