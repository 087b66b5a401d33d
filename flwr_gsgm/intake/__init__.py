"""Reply intake: a train reply unpacked and checked (envelope, metadata, arrays, the norm
bound) before the model sees it.
"""
