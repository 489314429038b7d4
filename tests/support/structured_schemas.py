"""20 JSON schemas of the shapes apps send (nested objects, enums, bounded arrays, number ranges,
required fields, anyOf, $ref/$defs, string formats and patterns), each with a prompt that
SmolLM2-135M can answer: strings and arrays are bounded so that a small model finishes."""

from __future__ import annotations

from typing import Any


def S(n: int) -> dict[str, Any]:
    """A string of at most `n` characters."""
    return {"type": "string", "maxLength": n}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person with a name and an age.", {"type": "object", "properties": {"name": S(24), "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("Is the sky blue? Answer yes or no with a confidence.", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": S(16), "minItems": 3, "maxItems": 3}}, "required": ["fruits"]}),
    ("Give a book with its title, author and year.", {"type": "object", "properties": {"title": S(40), "author": S(30), "year": {"type": "integer", "minimum": 1000, "maximum": 2030}}, "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Describe a city and its country.", {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": S(24), "country": {"type": "object", "properties": {"name": S(24), "code": {"type": "string", "pattern": "^[A-Z]{2}$"}}, "required": ["name", "code"]}}, "required": ["name", "country"]}}, "required": ["city"]}),
    ("Pick a color.", {"enum": ["red", "green", "blue"]}),
    ("Give the temperature of boiling water in Celsius.", {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -50, "maximum": 150}}, "required": ["celsius"]}),
    ("Schedule a meeting: give its date and time.", {"type": "object", "properties": {"date": {"type": "string", "format": "date"}, "time": {"type": "string", "format": "time"}}, "required": ["date", "time"]}),
    ("Give a contact email for support.", {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}, "required": ["email"]}),
    ("Give an order id and its status.", {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}, "status": {"enum": ["pending", "shipped", "delivered"]}}, "required": ["order_id", "status"]}),
    ("Give either a circle with a radius or a square with a side.", {"anyOf": [{"type": "object", "properties": {"shape": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 100}}, "required": ["shape", "radius"]}, {"type": "object", "properties": {"shape": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}}, "required": ["shape", "side"]}]}),
    ("Give two points with x and y.", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"]}),
    ("Rate a movie from 1 to 5 with a short review.", {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "review": S(60)}, "required": ["rating", "review"]}),
    ("Is water wet? Answer true or false.", {"type": "object", "properties": {"wet": {"type": "boolean"}}, "required": ["wet"]}),
    ("Give up to four tags for a blog post about cooking.", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,12}$"}, "minItems": 1, "maxItems": 4}}, "required": ["tags"]}),
    ("Give a product with a price in dollars and whether it is in stock.", {"type": "object", "properties": {"product": S(30), "price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}}, "required": ["product", "price", "in_stock"]}),
    ("Give a server's hostname and IPv4 address.", {"type": "object", "properties": {"hostname": {"type": "string", "format": "hostname", "maxLength": 30}, "ip": {"type": "string", "format": "ipv4"}}, "required": ["hostname", "ip"]}),
    ("Give a list of two steps to make tea, each with a number and a text.", {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": S(40)}, "required": ["n", "text"]}, "minItems": 2, "maxItems": 2}}, "required": ["steps"]}),
    ("Give a user with an optional nickname and a role.", {"type": "object", "properties": {"user": S(20), "nickname": {"anyOf": [S(20), {"type": "null"}]}, "role": {"enum": ["admin", "user", "guest"]}}, "required": ["user", "nickname", "role"]}),
    ("Give a unique id for a new record.", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "version": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["id", "version"]}),
]  # fmt: skip
