"""Generate bench/dev_chat_prompts.jsonl: MT-bench-like development prompts for specpipe.

48 two-turn chat questions, 6 in each of the eight MT-bench categories (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities), in Spec-Bench's question format: one
JSON object per line with ``question_id`` (int), ``category`` (str) and ``turns`` (two user
turns). The benchmark groups these categories into one ``mt_bench`` task, as Spec-Bench's own
evaluation does.

Every question below was written for this file; none is taken from, or modelled on, MT-bench or
Spec-Bench (those stay a held-out evaluation). The ids start at 101 so that this file can be
concatenated with bench/dev_prompts.jsonl (ids 1-72) without clashes. The self-distilled chat
corpus (specpipe.distill) is checked to share no prompt, exact or near-duplicate, with this file.

Usage:  python bench/make_chat_dev_prompts.py [OUTPUT]   (default: next to this file)
"""

import json
import sys
from pathlib import Path

FIRST_ID = 101

QUESTIONS: dict[str, list[tuple[str, str]]] = {
    "writing": [
        ("Write a cover letter for a part-time barista job at a small independent coffee shop. I have "
         "two years of experience working in a bakery and I am studying graphic design.",
         "Make it shorter, about 120 words, and a bit more casual in tone."),
        ("Write a short story (under 300 words) about a retired postman who keeps receiving letters "
         "addressed to a house that was demolished years ago.",
         "Give the story a title and write a one-sentence teaser for it that could go on the back cover."),
        ("Draft a speech of about 200 words that a team captain could give to a youth football team "
         "after losing the regional final.",
         "Rewrite the last paragraph so that it ends with a line the kids could chant together."),
        ("Write a product description for a reusable lunch box made of bamboo fibre, aimed at parents "
         "of primary school children.",
         "Now write three short social media posts promoting the same lunch box, each under 30 words."),
        ("Write a blog post introduction (around 150 words) about learning to play the ukulele as an "
         "adult beginner.",
         "Suggest five subheadings for the rest of the blog post."),
        ("Compose a free-verse poem about the first snowfall in a busy city.",
         "Rewrite the poem as a limerick that keeps its main image."),
    ],
    "roleplay": [
        ("You are a grumpy but kind-hearted innkeeper in a medieval fantasy town. A tired traveller "
         "walks in late at night asking for a room. Greet them.",
         "The traveller admits they cannot pay tonight but offers to work in the kitchen tomorrow. "
         "How do you respond?"),
        ("Pretend to be a personal fitness coach talking to a client who wants to run their first "
         "5 km race in two months. Start the first session.",
         "The client says they hurt their knee last year. Adjust your plan and explain why."),
        ("Act as a tour guide on a night walk through an old harbour town, telling the group a local "
         "legend about a ghost ship.",
         "A sceptical teenager in the group says ghosts are not real. Reply in character."),
        ("You are an AI assistant on a spaceship that has just woken its crew from a long sleep. "
         "Brief the captain on the state of the ship.",
         "The captain asks why one of the sleep pods failed to open. Answer calmly and in character."),
        ("Play the role of a job interviewer at a software company. Ask me your first three "
         "questions for a junior developer position.",
         "I answered that my biggest weakness is perfectionism. Give feedback on that answer as the "
         "interviewer."),
        ("You are a 19th-century botanist writing in your field journal after discovering a new "
         "species of orchid in a rainforest. Write today's entry.",
         "Write the next day's entry, in which you realise a rival botanist has been following you."),
    ],
    "reasoning": [
        ("A farmer needs to cross a river with a goat, a wolf and a basket of lettuce. The boat holds "
         "the farmer and one item. The wolf eats the goat and the goat eats the lettuce if left alone "
         "together. How does the farmer get everything across?",
         "What is the smallest number of crossings needed? Explain why fewer is impossible."),
        ("Five runners finished a race. Mia finished before Leo but after Sam. Jon finished last. "
         "Eva finished right after Sam. In what order did they finish?",
         "If a sixth runner, Kai, finished between Leo and Jon, what position did Leo finish in?"),
        ("A clock shows 3:15. What is the angle between the hour hand and the minute hand? Explain "
         "step by step.",
         "At what time between 3:00 and 4:00 do the two hands overlap exactly?"),
        ("If it takes 4 machines 4 minutes to make 4 widgets, how long does it take 50 machines to "
         "make 50 widgets? Explain your answer.",
         "Explain why many people give the wrong answer to this kind of question."),
        ("In a village, every person either always tells the truth or always lies. You meet two "
         "villagers. The first says: 'At least one of us is a liar.' What are the two villagers?",
         "Now suppose the first villager had said 'We are both liars.' What follows?"),
        ("A bag contains 3 red, 4 blue and 5 green marbles. Without looking, what is the smallest "
         "number of marbles you must take to be sure of having two of the same colour?",
         "How many must you take to be sure of having three green marbles?"),
    ],
    "math": [
        ("Solve the system of equations 3x + 2y = 16 and x - y = 2. Show your steps.",
         "Check your solution by substituting it back into both equations."),
        ("A rectangular garden is 12 m long and 7 m wide. A path 1 m wide runs around the outside of "
         "it. What is the area of the path?",
         "If paving the path costs 18 euros per square metre, how much does it cost in total?"),
        ("What is the sum of all integers from 1 to 200 that are divisible by 3 or by 5?",
         "Generalise your method into a formula for the sum of multiples of 3 or 5 up to any n."),
        ("Two fair dice are rolled. What is the probability that the sum is a prime number?",
         "What is the probability that the sum is prime given that at least one die shows a 4?"),
        ("Find the derivative of f(x) = x^3 * ln(x) and the x-coordinate of its critical point for "
         "x > 0.",
         "Is that critical point a minimum or a maximum? Justify your answer."),
        ("A savings account pays 4% interest per year, compounded annually. If you deposit 2,500 "
         "dollars, how much will be in the account after 6 years?",
         "How many whole years does it take for the balance to at least double?"),
    ],
    "coding": [
        ("Write a Python function that checks whether a string is a valid palindrome when you ignore "
         "spaces, punctuation and letter case.",
         "Rewrite it so that it uses two pointers and no extra copy of the string."),
        ("Write a SQL query that returns, for each department, the name of the employee with the "
         "highest salary. The table is employees(id, name, department, salary).",
         "How would you change the query so that ties return all of the top earners?"),
        ("Implement a simple stack class in JavaScript with push, pop, peek and isEmpty methods.",
         "Add a method that returns the minimum element in constant time, and explain how it works."),
        ("Write a Bash script that finds all .log files older than 7 days in a directory given as the "
         "first argument and compresses them with gzip.",
         "Add a --dry-run option that only prints what would be compressed."),
        ("Here is a Python function with a bug:\n\ndef average(values):\n    total = 0\n    for v in "
         "values:\n        total += v\n    return total / len(values) - 1\n\nFind the bug and fix it.",
         "Also make the function handle an empty list gracefully."),
        ("Explain what a race condition is and show a short Python example using threads that has "
         "one.",
         "Fix the example using a lock."),
    ],
    "extraction": [
        ("From the following order confirmation, extract the order number, the items with their "
         "quantities, and the delivery date as JSON.\n\nThank you for shopping with Greenleaf Home! "
         "Your order #GL-48213 has been confirmed. You ordered 2 ceramic plant pots, 1 watering can "
         "and 3 bags of potting soil. Your parcel will arrive on Thursday, 9 May.",
         "Add the total number of items to the JSON."),
        ("List every city mentioned in this paragraph together with the country it is in.\n\nAfter "
         "a week in Porto, Lena took the train to Madrid and then flew to Krakow. Her brother stayed "
         "behind in Seville before joining her for the last two days in Vienna.",
         "Sort the cities in the order Lena visited them, leaving out the ones she did not visit."),
        ("Read these three short reviews and give each one a rating from 1 to 5 with a one-word "
         "reason.\n\n1. 'Battery died after two days, and support never answered.'\n2. 'Does the job, "
         "nothing special, a bit noisy.'\n3. 'Best headphones I have owned, the sound is amazing.'",
         "Return your answer as a CSV table with the columns review, rating and reason."),
        ("Extract the names of all people and their job titles from this text.\n\nThe meeting was "
         "opened by Dr. Helen Park, the head of research. She introduced Marco Diaz, the new lab "
         "manager, and thanked the finance director, Aisha Bello, for approving the budget.",
         "Which of these people were only mentioned and did not speak, as far as the text says?"),
        ("From this recipe, list the ingredients with their amounts and the total cooking time.\n\n"
         "Melt 50 g butter in a pan, add one chopped onion and cook for 5 minutes. Stir in 200 g of "
         "rice, pour in 600 ml of stock and simmer for 18 minutes. Finish with 30 g of grated cheese.",
         "Scale the ingredient amounts for a recipe that serves twice as many people."),
        ("Identify the dates and the events they refer to in this text, and present them as a "
         "timeline.\n\nThe bridge was designed in 1931, but construction only began in 1936 because "
         "of funding problems. It opened to traffic in March 1941 and was badly damaged by a flood in "
         "1957. A full restoration was finished in 1989.",
         "How many years passed between the design and the opening of the bridge?"),
    ],
    "stem": [
        ("Why does ice float on water, when most solids are denser than their liquid form?",
         "What would happen to lakes in winter if ice were denser than water?"),
        ("Explain how vaccines train the immune system, in language a twelve-year-old would "
         "understand.",
         "What is the difference between a vaccine and an antibiotic?"),
        ("What is the greenhouse effect, and how is it different from the ozone hole?",
         "Give two everyday examples that help explain the greenhouse effect."),
        ("Explain Ohm's law and use it to find the current through a 220 ohm resistor connected to a "
         "9 volt battery.",
         "If two such resistors are connected in parallel to the same battery, what is the total "
         "current?"),
        ("How does GPS work out your position on Earth?",
         "Why do GPS satellites need to correct their clocks for relativity?"),
        ("What is the difference between DNA and RNA?",
         "Summarise your answer as a table."),
    ],
    "humanities": [
        ("What were the main causes of the French Revolution?",
         "Which of these causes do you think mattered most, and why? Answer in one paragraph."),
        ("Explain the idea of opportunity cost with an everyday example.",
         "How does opportunity cost apply to a government deciding its budget?"),
        ("Compare the philosophies of Stoicism and Epicureanism.",
         "Which of the two would be more helpful for someone dealing with stress at work? Explain."),
        ("Why was the printing press so important for European society?",
         "Is there a modern invention with a similar impact? Make a case for one."),
        ("What is the difference between a democracy and a republic?",
         "Give two examples of countries that are both, and explain why."),
        ("Describe the main features of Impressionist painting and name three important painters of "
         "the movement.",
         "How did photography influence the Impressionists?"),
    ],
}


def build() -> list[dict]:
    rows = []
    for category, questions in QUESTIONS.items():
        assert len(questions) == 6, f"{category}: {len(questions)} questions, expected 6"
        for turns in questions:
            rows.append({"question_id": FIRST_ID + len(rows), "category": category, "turns": list(turns)})
    return rows


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("dev_chat_prompts.jsonl")
    rows = build()
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} questions to {out}")


if __name__ == "__main__":
    main()
