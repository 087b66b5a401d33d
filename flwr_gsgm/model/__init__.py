"""The global model by array name: the trainable arrays a core rule steps, the buffers, and
both joined.
"""
