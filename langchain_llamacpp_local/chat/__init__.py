"""From a chat request to what the model reads: prompt preparation, special-token
safety, images, log-probabilities and the weights-free prompt preview.
"""
