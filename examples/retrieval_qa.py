"""Retrieve, then answer: a small all-local RAG chain.

One GGUF does both jobs: ``LlamaCppEmbeddings`` and ``ChatLlamaCpp`` on the same file
share one loaded model (two llama.cpp contexts, one copy of the weights). An optional
reranker GGUF (``--rerank bge-reranker-v2-m3-Q8_0.gguf``) reorders what was retrieved.

Run: python examples/retrieval_qa.py [model.gguf] [--embed embedding-model.gguf]
                                     [--rerank reranker.gguf]

With SmolLM2-135M-Instruct alone (the default) the embeddings are mean-pooled hidden states
of a chat model: good enough to show the plumbing; a real embedding GGUF (nomic, bge, E5,
EmbeddingGemma, Qwen3-Embedding) passed with --embed retrieves far better.
"""

from __future__ import annotations

import argparse

from _demo import default_model, max_tokens
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank

NOTES = [
    "The museum opens at 10:00 and closes at 17:00; it is closed on Mondays.",
    "The old railway runs to the summit every hour from 9:00; the last train down is at 18:00.",
    "The lake is warm enough to swim from late June to early September.",
    "The August festival has a lantern parade on the last Saturday of the month.",
    "The tourist office is next to the station and lends maps for the trails.",
    "The easiest trail is the Lakeside Loop: 5 km, flat, about 90 minutes.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "model", nargs="?", default=None, help="chat GGUF (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--embed", default=None, help="embedding GGUF (default: the chat model)")
    ap.add_argument("--rerank", default=None, help="reranker GGUF (pooling 'rank')")
    ap.add_argument("--question", default="When can I take the train down from the summit?")
    args = ap.parse_args()
    path = args.model or default_model()

    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(64))
    embeddings = LlamaCppEmbeddings(model_path=args.embed or path)
    store = InMemoryVectorStore(embeddings)
    store.add_documents([Document(page_content=t) for t in NOTES])
    search = store.as_retriever(search_kwargs={"k": 4 if args.rerank else 2})
    reranker = LlamaCppRerank(model_path=args.rerank, top_n=2) if args.rerank else None

    def retrieve(question: str) -> list[Document]:
        docs = search.invoke(question)
        return list(reranker.compress_documents(docs, question)) if reranker else docs

    retriever = RunnableLambda(retrieve)

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from these notes only, in one sentence.\n\n{context}"),
            ("human", "{question}"),
        ]
    )
    chain = (
        {
            "context": retriever | (lambda docs: "\n".join(d.page_content for d in docs)),
            "question": RunnablePassthrough(),
        }
        | prompt
        | llm
        | StrOutputParser()
    )
    for doc in retriever.invoke(args.question):
        print("retrieved:", doc.page_content, doc.metadata or "")
    print("answer:", chain.invoke(args.question))


if __name__ == "__main__":
    main()
