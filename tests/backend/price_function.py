"""A short Python function that prompts ask to edit: most of the answer copies it, so n-gram drafts are accepted
(bench/speculative.py's extractive workload; tests/backend/test_smollm2.py's check that speculation keeps plain
decoding's tokens)."""

PRICE_FUNCTION = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
