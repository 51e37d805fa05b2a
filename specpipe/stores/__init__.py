"""On-disk datastores the Retrieve stages read: a suffix array over token ids (REST), a FAISS
document store (RAG), and the store of past outputs. Every store is a folder with a JSON
manifest, written atomically (see `specpipe.stores.manifest`)."""
