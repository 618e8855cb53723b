"""Shared machinery of attnops: errors, validation, layouts, sequence lengths, masks, pse, dropout, dispatch.

Nothing here knows operator math; every operator family builds on these modules.
"""
