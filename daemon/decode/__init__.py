"""One request's decoding: the rounds across the two workers, the target alone, and the text a
request streams.
"""
