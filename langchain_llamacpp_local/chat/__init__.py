"""The front end: from a chat request to the worker's token request, and from its reply
to LangChain messages. Prompt preparation, special-token safety, images, the reply
reader (output parser, logprobs, usage), structured output and the weights-free prompt
preview; all of it runs on the caller's side, never on the decode loop.
"""
