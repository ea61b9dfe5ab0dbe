"""The built-in demo model: a small llama trained to answer questions about an attached document."""
