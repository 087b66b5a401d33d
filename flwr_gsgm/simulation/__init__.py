"""Simulation: the seeded virtual clock (the time model) and a Flower Grid that runs a
ClientApp in-process.
"""
